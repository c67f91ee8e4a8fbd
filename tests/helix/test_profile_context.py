"""The profile's optional decode context cost: given together, priced by derive_tok_s."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helix.profile import ThroughputProfile, derive_tok_s

CURVES = dict(max_layers=4, prefill_ms_per_layer=[(0, 0), (256, 10.0)], decode_ms_per_layer=[(0, 0), (1, 1.0), (32, 2.0)],
              kv_capacity_tokens_by_layers=[1e9] * 4)


def test_context_fields_come_together() -> None:
    with pytest.raises(ValidationError, match="together"):
        ThroughputProfile(**CURVES, decode_context_tokens=64.0)
    with pytest.raises(ValidationError, match="together"):
        ThroughputProfile(**CURVES, decode_ms_per_context_token=0.001)


def test_context_cost_prices_the_workload_context() -> None:
    plain = ThroughputProfile(**CURVES)
    priced = ThroughputProfile(**CURVES, decode_context_tokens=64.0, decode_ms_per_context_token=0.001)
    assert plain.decode_context_ms(1000) == 0.0
    assert priced.decode_context_ms(1064) == pytest.approx(1.0)  # 1000 tokens beyond, 0.001 ms each
    assert priced.decode_context_ms(32) == pytest.approx(-0.032)  # below the measured context: cheaper
    # the Azure mix's mean context (~879 tokens) is well beyond 64: every layer count is slower
    assert all(a < b for a, b in zip(derive_tok_s(priced), derive_tok_s(plain), strict=True))


def test_the_planner_serving_model_prices_the_same_context() -> None:
    from helix.profile import GpuProfile, ModelProfile, ProfileSet
    from helix.spec import ClusterSpec
    from planner.capacity import CapacityModel
    from planner.serving_model import ServingModel

    model = ModelProfile(num_layers=4, hidden_size=8, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"}, "nodes": [{"id": "n0", "gpu": "g"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 1000, "latency_ms": 0.0}}})

    def decode_s(**extra: float) -> float:
        tp = ThroughputProfile(**CURVES, **extra)
        cap = CapacityModel.build(cluster, ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})}))
        return ServingModel(cap).decode_s("n0", 4, 8.0, last=True)

    plain, priced = decode_s(), decode_s(decode_context_tokens=64.0, decode_ms_per_context_token=0.001)
    context = 763 + 232 / 2  # the default workload's mean context
    # 4 layers x 8 requests x (context - 64) x 0.001 ms more per step
    assert priced - plain == pytest.approx(4 * 8 * (context - 64) * 0.001 / 1000)
