"""From probe stages' step times to helix.profile's cost parts: per layer, per step, the head.

:func:`profiler.measure.measure_device` times two middle stages of different lengths and the
last layer; :func:`layer_slopes` is the per-layer cost between the two middle stages (the
engine's fixed per-step cost cancels), and :func:`with_step_costs` splits a measured result
(fresh or cached by an older version) into the pure per-layer curves, ``step_overhead_ms``
(paid once per stage step) and ``head_ms`` (paid by the last stage alone). No torch needed.
"""

from __future__ import annotations

from typing import Any


def with_step_costs(measured: dict[str, Any]) -> dict[str, Any]:
    """Split the fixed per-step costs out of the per-layer curves (helix.profile's contract).

    ``measured`` is :func:`profiler.measure.measure_device`'s result (also older cached ones, whose per-layer
    curves still carry ``head / num_layers`` on every point); from its ``raw`` part:

    * per-layer curves = the pure slopes ``prefill_layer_ms`` / ``decode_layer_ms``;
    * ``step_overhead_ms`` by batch tokens = the shorter stage minus its layers: the decode
      points (``b`` requests = ``b`` batch tokens), then the prefill points above the largest
      decode batch;
    * ``head_ms`` by batch size = the last stage minus one layer and the fixed cost, from the decode runs
      (``b`` sequences sampling one token each).

    Without ``raw`` (or already split) it is returned unchanged.
    """
    raw = measured.get("raw")
    if raw is None or "step_overhead_ms" in measured or "decode_fixed_ms" not in raw:
        return measured
    pre_x = [p[0] for p in measured["prefill_ms_per_layer"] if p[0] > 0]
    dec_x = [p[0] for p in measured["decode_ms_per_layer"] if p[0] > 0]
    out = dict(measured)
    out["prefill_ms_per_layer"] = [[0.0, 0.0]] + [[x, round(ms, 4)] for x, ms in zip(pre_x, raw["prefill_layer_ms"], strict=True)]
    out["decode_ms_per_layer"] = [[0.0, 0.0]] + [[x, round(ms, 4)] for x, ms in zip(dec_x, raw["decode_layer_ms"], strict=True)]
    top = max(dec_x)
    step = [[x, round(ms, 4)] for x, ms in zip(dec_x, raw["decode_fixed_ms"], strict=True)]
    step += [[x, round(ms, 4)] for x, ms in zip(pre_x, raw["prefill_fixed_ms"], strict=True) if x > top]
    out["step_overhead_ms"] = step
    out["head_ms"] = [[x, round(max(0.0, h - f), 4)]
                      for x, h, f in zip(dec_x, raw["decode_head_ms"], raw["decode_fixed_ms"], strict=True)]
    return out


def layer_slopes(short: list[float], long: list[float], short_layers: int, long_layers: int) -> list[float]:
    """Per-layer ms from the step times of two stages of ``short_layers`` and ``long_layers``
    layers (the fixed part cancels); at least a quarter of the plain average, so noise cannot
    make a layer free."""
    span = long_layers - short_layers
    return [max((b - a) / span, b / long_layers / 4) for a, b in zip(short, long, strict=True)]
