"""`helix profile --estimate`: the KV reserve is the user's to choose, and each GPU's limit is explained."""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.cli import main as helix_main
from helix.profile import load_profile_file
from profiler.gpus import BUILTIN_MODELS, gpu_spec
from profiler.kv_reserve import KvReserve
from profiler.roofline import Roofline

LLAMA70 = BUILTIN_MODELS["llama-2-70b"]


def _out(capsys: pytest.CaptureFixture[str]) -> str:
    out = capsys.readouterr()
    return " ".join((out.out + out.err).split())


def test_estimate_prints_what_limits_each_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert helix_main(["profile", "--estimate", "--gpus", "A100-80GB,T4", "--model", "llama-2-70b"]) == 0
    out = _out(capsys)
    assert "KV reserve of 254,720 tokens in every layer held (256 requests x 995 tokens)" in out
    assert ("T4 (16 GB VRAM): 12.8 GB for weights + KV, 1.71 GB weights + 1.04 GB KV per layer -> at most 4 layers "
            "(weights alone: 7)") in out  # fmt: skip
    assert "A100-80GB (80 GB VRAM): 70.4 GB for weights + KV" in out and "at most 25 layers" in out
    out_file = tmp_path / "p.yaml"
    assert helix_main(["profile", "--estimate", "--gpus", "T4", "--model", "llama-2-70b", "--kv-requests", "64",
                       "--kv-context-tokens", "2048", "-o", str(out_file)]) == 0  # fmt: skip
    assert "131,072 tokens in every layer held (64 requests x 2048 tokens)" in _out(capsys)
    assert "max_layers of T4 keeps the KV reserve of 131,072 tokens" in out_file.read_text()  # the file says how
    assert load_profile_file(out_file).throughput("T4", "llama-2-70b").max_layers == 5
    # -o into an existing file merges: its other GPUs stay, the new estimate wins
    assert helix_main(["profile", "--estimate", "--gpus", "L4", "--model", "llama-2-70b", "-o", str(out_file)]) == 0
    assert set(load_profile_file(out_file).gpus) == {"T4", "L4"}


def test_kv_reserve_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["profile", "--estimate", "--gpus", "T4", "--model", "llama-2-70b"]
    assert helix_main([*base, "--kv-reserve-gb", "4", "--kv-requests", "8"]) == 2
    assert "--kv-reserve-gb: give either --kv-reserve-gb or --kv-requests" in _out(capsys)
    assert helix_main([*base, "--kv-requests", "0"]) == 2
    assert "--kv-requests: must be 1 or more" in _out(capsys)
    assert helix_main([*base, "--kv-reserve-gb", "20"]) == 3  # a T4 keeps no room for a layer
    assert "cannot hold one layer of llama-2-70b with its KV reserve" in _out(capsys)


def test_fixed_and_per_layer_reserves() -> None:
    t4 = gpu_spec("T4")
    assert Roofline().max_layers(t4, LLAMA70) == 4  # the paper's rule, unchanged
    assert Roofline(kv_reserve=KvReserve.fixed_gb(0)).max_layers(t4, LLAMA70) == 7  # weights alone
    assert Roofline(kv_reserve=KvReserve.fixed_gb(4)).max_layers(t4, LLAMA70) == 5
    assert Roofline(kv_reserve=KvReserve.for_requests(1, 1)).max_layers(gpu_spec("H100"), LLAMA70) == 41
    assert Roofline().max_layers(gpu_spec("H100"), BUILTIN_MODELS["smollm2-135m"]) == 30  # never past the model
