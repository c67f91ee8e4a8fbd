"""Writing what the profiler produced: the profiles file, the measured links, the cache.

The profiles file is the ``ProfileSet`` format of :mod:`helix.profile` (read back with
``helix.profile.load_profile_file``); measuring writes it to ``profiles-measured.yaml`` next to
the cluster unless told otherwise (never over the cluster's own profiles files by default).
Measured links are a small YAML beside it (``links-measured.yaml``) with the same ``links:``
entries a cluster file takes, so a user can paste them into the cluster. The cache keeps one
JSON file per (model, device, dtype, ...) measurement so a rerun is instant unless ``--force``;
it lives in the user's cache directory (:func:`default_cache_dir`), never in the checkout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from helix.profile import ProfileSet
from helix.smollm2 import cache_root

MEASURED_PROFILES_NAME = "profiles-measured.yaml"
LINKS_FILE_NAME = "links-measured.yaml"


def default_cache_dir() -> Path:
    """Where measurements are cached: ``profile/`` under Helix's cache root (``$HELIX_CACHE``,
    else ``$XDG_CACHE_HOME/helix``, else ``~/.cache/helix``)."""
    return cache_root() / "profile"


def write_profiles(path: str | Path, profiles: ProfileSet, header: str = "") -> Path:
    """Write a ProfileSet as YAML (with an optional ``#`` comment header)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(profiles.model_dump(mode="json", exclude_none=True), sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    p.write_text(comment + body)
    return p


def write_links(path: str | Path, links: list[dict[str, Any]], header: str = "") -> Path:
    """Write measured links (``src``, ``dst``, ``bandwidth_gbps``, ``latency_ms``) as YAML."""
    p = Path(path)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    p.write_text(comment + yaml.safe_dump({"links": links}, sort_keys=False))
    return p


class ProfileCache:
    """One JSON file per measurement key; a key is any JSON-able dict (model, device, dtype, ...)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{digest}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return entry.get("value") if entry.get("key") == key else None

    def put(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path(key).write_text(json.dumps({"key": key, "value": value}, indent=1))
