"""``helix profile`` writes where the user says, never over the checkout's files, and caches
outside the tree."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helix.profile import load_profile_file
from helix.spec import load_cluster
from profiler.cluster_profile import profile_cluster
from profiler.files import default_cache_dir
from profiler.kv_reserve import KvReserve
from profiler.measure import MeasureSettings

ROOT = Path(__file__).resolve().parents[2]
QUICK = MeasureSettings(probe_layers=1, prefill_tokens=(8,), decode_batches=(1, 2), context_tokens=8, repeats=1,
                        long_context_tokens=24, context_batch=1, pet_types=())  # fmt: skip


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_profiling_the_demo_leaves_the_checkout_as_it_was(tmp_path: Path, isolated_cache: Path) -> None:
    # a checkout holding what this one tracks for the demo, and its .gitignore
    repo = tmp_path / "checkout"
    for name in [*_git(ROOT, "ls-files", "clusters/demo").split(), ".gitignore"]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "checkout")
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""

    cluster = repo / "clusters" / "demo" / "cluster.yaml"
    result = profile_cluster(load_cluster(cluster), settings=QUICK)
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    # the outputs are there, next to the cluster, and the cache is in the user's cache dir
    assert result.profiles_path == cluster.parent / "profiles-measured.yaml"
    assert result.links_path == cluster.parent / "links-measured.yaml" and result.links_path.is_file()
    assert "cpu" in load_profile_file(result.profiles_path).gpus
    assert any((isolated_cache / "profile").iterdir())

    # -o: the profiles file where the user says, the links beside it; a rerun comes from the cache
    out = tmp_path / "mine" / "profiles.yaml"
    again = profile_cluster(load_cluster(cluster), settings=QUICK, output=out, kv_reserve=KvReserve.fixed_gb(0.5))
    assert again.cache_hits == ["cpu"] and again.profiles_path == out
    assert "max_layers keeps the KV reserve of 0.5 GB per GPU" in out.read_text()  # the file says which
    assert again.links_path == out.parent / "links-measured.yaml" and again.links_path.is_file()
    mine, first = (load_profile_file(f).throughput("cpu", "smollm2-135m") for f in (out, result.profiles_path))
    assert mine.decode_ms_per_layer == first.decode_ms_per_layer  # the cached measurement (free memory may move)
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""


def test_cache_dir_follows_helix_cache_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELIX_CACHE", str(tmp_path / "h"))
    assert default_cache_dir() == tmp_path / "h" / "profile"
    monkeypatch.delenv("HELIX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "helix" / "profile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "helix" / "profile"
