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
