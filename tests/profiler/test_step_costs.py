"""Splitting the measured fixed per-step costs out of the per-layer curves (no torch needed)."""

from __future__ import annotations

import pytest

from profiler.nodes import combine
from profiler.step_costs import with_step_costs


def _measured(scale: float = 1.0) -> dict:
    n = 30
    pre_layer, dec_layer = [1.0, 3.0], [0.5, 0.6]
    pre_fixed, dec_fixed = [2.0, 2.5], [1.0, 1.5]
    pre_head, dec_head = [9.0, 9.5], [5.0, 7.0]  # last stage - one layer: fixed + head
    return {
        "num_layers": n, "hidden_size": 8, "dtype_bytes": 4, "layer_weight_bytes": 1.0,
        "kv_bytes_per_token_per_layer": 1.0,
        "prefill_ms_per_layer": [[0.0, 0.0], [16.0, 1.0 + 9.0 / n], [64.0, 3.0 + 9.5 / n]],
        "decode_ms_per_layer": [[0.0, 0.0], [1.0, 0.5 + 5.0 / n], [32.0, 0.6 + 7.0 / n]],
        "raw": {"prefill_layer_ms": pre_layer, "prefill_head_ms": pre_head, "decode_layer_ms": dec_layer,
                "decode_head_ms": dec_head, "prefill_fixed_ms": pre_fixed, "decode_fixed_ms": [x * scale for x in dec_fixed]},
    }


def test_split_gives_pure_layers_a_step_cost_and_a_head() -> None:
    out = with_step_costs(_measured())
    assert out["prefill_ms_per_layer"] == [[0.0, 0.0], [16.0, 1.0], [64.0, 3.0]]
    assert out["decode_ms_per_layer"] == [[0.0, 0.0], [1.0, 0.5], [32.0, 0.6]]
    # decode points by batch size, then the prefill points above the largest decode batch
    assert out["step_overhead_ms"] == [[1.0, 1.0], [32.0, 1.5], [64.0, 2.5]]
    assert out["head_ms"] == [[1.0, 4.0], [32.0, 5.5]]
    assert with_step_costs(out) is out  # already split


def test_combine_keeps_the_step_curves() -> None:
    out = combine([_measured(), _measured(1.2), _measured(0.8)])
    assert out["step_overhead_ms"][0] == [1.0, pytest.approx(1.0)]
    assert "raw" not in out and out["nodes_combined"] == 3
