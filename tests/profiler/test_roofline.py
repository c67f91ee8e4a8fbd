"""Roofline estimates: shapes, monotonic curves, memory rules, and the paper's tables within a factor."""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.errors import ConfigError, InfeasiblePlanError
from helix.profile import derive_tok_s, load_profile_file
from profiler.gpus import BUILTIN_GPUS, BUILTIN_MODELS, GpuSpec, gpu_spec, load_model_shape
from profiler.roofline import Roofline, estimate_profiles, estimate_throughput

# the paper's per-layer curves and KV table (its artifact's gpus-llama70b.yaml, in our profile format)
PAPER = Path(__file__).resolve().parents[2] / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml"
LLAMA70 = BUILTIN_MODELS["llama-2-70b"]
# The documented factor (docs/profiler.md): per-layer latencies and derived tok/s of the
# spec-sheet estimate stay within 2.5x of the paper's vLLM measurements for A100, L4 and T4.
PAPER_FACTOR = 2.5


def test_llama70b_constants_match_the_design_example() -> None:
    assert LLAMA70.layer_weight_bytes == 1711276032
    assert LLAMA70.kv_bytes_per_token_per_layer == 4096


@pytest.mark.parametrize("name", sorted(BUILTIN_GPUS))
def test_curves_are_monotonic_and_positive(name: str) -> None:
    tp = estimate_throughput(BUILTIN_GPUS[name], LLAMA70)
    for curve in (tp.prefill_ms_per_layer, tp.decode_ms_per_layer):
        assert curve is not None
        assert sorted(curve)[0] == (0.0, 0.0)
        ys = [ms for x, ms in sorted(curve) if x > 0]
        assert all(y > 0 for y in ys)
        assert ys == sorted(ys)
    kv = tp.kv_capacity_tokens_by_layers
    assert kv is not None and len(kv) == tp.max_layers
    assert all(a > b > 0 for a, b in zip(kv, kv[1:], strict=False))


def test_more_vram_holds_more_layers() -> None:
    small = estimate_throughput(gpu_spec("A100-40GB"), LLAMA70)
    big = estimate_throughput(gpu_spec("A100-80GB"), LLAMA70)
    assert big.max_layers > small.max_layers
    assert big.kv_capacity_tokens_by_layers[0] > small.kv_capacity_tokens_by_layers[0]  # type: ignore[index]


def test_faster_gpu_is_faster() -> None:
    rl = Roofline()
    assert rl.decode_ms(gpu_spec("H100"), LLAMA70, 8) < rl.decode_ms(gpu_spec("A100"), LLAMA70, 8)
    assert rl.prefill_ms(gpu_spec("A100"), LLAMA70, 2048) < rl.prefill_ms(gpu_spec("T4"), LLAMA70, 2048)


def test_layer_limits_reproduce_the_paper() -> None:
    limits = {g: estimate_throughput(gpu_spec(g), LLAMA70).max_layers for g in ("A100", "L4", "T4")}
    assert limits == {"A100": 12, "L4": 7, "T4": 4}


def test_a_gpu_too_small_for_one_layer_is_refused() -> None:
    with pytest.raises(InfeasiblePlanError, match="cannot hold one layer"):
        estimate_throughput(GpuSpec("tiny", 10.0, 100.0, vram_gb=2.0), LLAMA70)


def test_unknown_gpu_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown GPU 'B200'.*A100-40GB"):
        gpu_spec("B200")
    assert gpu_spec("a100").name == "A100-40GB" and gpu_spec("rtx_4090").name == "RTX4090"


def test_model_from_hf_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,'
                   ' "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}')  # fmt: skip
    shape = load_model_shape(str(tmp_path))
    assert (shape.num_layers, shape.head_dim, shape.num_kv_heads, shape.dtype_bytes) == (4, 16, 2, 4)
    assert shape.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4
    (tmp_path / "bad.yaml").write_text("hidden_size: 64\n")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model_shape(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="not a built-in model"):
        load_model_shape("no-such-model")


def test_estimates_derive_a_tok_s_table() -> None:
    profiles = estimate_profiles({"A100": gpu_spec("A100"), "T4": gpu_spec("T4")}, LLAMA70)
    model = profiles.models["llama-2-70b"]
    a100 = profiles.throughput("A100", "llama-2-70b").tok_s_table(model)
    t4 = profiles.throughput("T4", "llama-2-70b").tok_s_table(model)
    assert len(a100) == 12 and len(t4) == 4
    assert a100 == sorted(a100, reverse=True)
    assert a100[0] > t4[0]


@pytest.mark.parametrize("gpu", ["A100", "L4", "T4"])
def test_estimates_within_documented_factor_of_the_paper(gpu: str) -> None:
    measured = load_profile_file(PAPER).throughput(gpu, "llama-2-70b")
    assert measured.prefill_ms_per_layer and measured.decode_ms_per_layer and measured.kv_capacity_tokens_by_layers
    est = estimate_throughput(gpu_spec(gpu), LLAMA70)
    rl = Roofline()
    for t, ms in measured.prefill_ms_per_layer:
        if t >= 1000:
            ratio = rl.prefill_ms(gpu_spec(gpu), LLAMA70, t) / ms
            assert 1 / PAPER_FACTOR < ratio < PAPER_FACTOR, (t, ratio)
    for b, ms in measured.decode_ms_per_layer:
        if b > 0:
            ratio = rl.decode_ms(gpu_spec(gpu), LLAMA70, b) / ms
            assert 1 / PAPER_FACTOR < ratio < PAPER_FACTOR, (b, ratio)
    for e, m in zip(derive_tok_s(est), derive_tok_s(measured), strict=True):
        assert 1 / PAPER_FACTOR < e / m < PAPER_FACTOR
    kv_ratio = est.kv_capacity_tokens_by_layers[0] / measured.kv_capacity_tokens_by_layers[0]  # type: ignore[index]
    assert 0.8 < kv_ratio < 1.25
