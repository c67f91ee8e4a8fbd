"""Every profiler test gets its own measurement cache (``$HELIX_CACHE``), so a test never reads
another's results and nothing lands in the user's real cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "helix-cache"
    monkeypatch.setenv("HELIX_CACHE", str(cache))
    return cache
