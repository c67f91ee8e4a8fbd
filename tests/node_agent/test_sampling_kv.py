"""Sampling rules and KV accounting, plus the engine's KV report across a request's life."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helix.errors import CapacityError, RequestError
from node_agent.engine import StageEngine
from node_agent.kv_cache import KVAccount, RequestKV
from node_agent.sampling import (
    NUCLEUS_CANDIDATES,
    SamplingParams,
    finish_reason,
    make_generator,
    sample_token,
)

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])


def _draws(params: SamplingParams, n: int = 200) -> list[int]:
    gen = make_generator(params)
    return [sample_token(LOGITS, params, gen) for _ in range(n)]


def test_greedy_and_degenerate_cuts_pick_the_argmax() -> None:
    assert sample_token(LOGITS, SamplingParams(), make_generator(SamplingParams())) == 1
    assert set(_draws(SamplingParams(temperature=1.0, top_k=1, seed=3))) == {1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.01, seed=3))) == {1}


def test_top_k_and_top_p_restrict_the_support() -> None:
    assert set(_draws(SamplingParams(temperature=2.0, top_k=3, seed=1))) == {1, 2, 4}
    assert set(_draws(SamplingParams(temperature=2.0, top_p=0.5, seed=1))) <= {1, 2}
    assert {0, 3} & set(_draws(SamplingParams(temperature=5.0, seed=1), 2000))


def test_temperature_draws_follow_the_softmax() -> None:
    n = 20000
    counts = torch.bincount(torch.tensor(_draws(SamplingParams(temperature=1.5, seed=7), n)), minlength=5).double()
    expected = torch.softmax(LOGITS.double() / 1.5, dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (counts.tolist(), expected.tolist())  # 4 degrees of freedom, p = 0.001


def test_top_p_nucleus_beyond_the_candidate_shortlist() -> None:
    # a nearly flat, strictly decreasing distribution over 3000 tokens: the 0.6 nucleus holds
    # more tokens than the 1024-candidate shortlist, so the full sort must take over
    logits = -1e-4 * torch.arange(3000, dtype=torch.float32)
    probs = torch.softmax(logits.double(), dim=-1)
    nucleus = int(((probs.cumsum(0) - probs) < 0.6).sum())
    assert nucleus > NUCLEUS_CANDIDATES
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=5)
    gen = make_generator(params)
    draws = [sample_token(logits, params, gen) for _ in range(3000)]
    assert max(draws) < nucleus and max(draws) >= NUCLEUS_CANDIDATES
    # a peaked one: the nucleus is inside the shortlist and the draws follow it
    peaked = torch.zeros(3000)
    peaked[[7, 11, 13]] = torch.tensor([16.0, 15.0, 14.0])
    gen = make_generator(SamplingParams(seed=1))
    assert set(sample_token(peaked, SamplingParams(temperature=1.0, top_p=0.9), gen) for _ in range(500)) <= {7, 11, 13}


def test_seed_makes_draws_reproducible() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    assert _draws(p) == _draws(p)
    assert _draws(p) != _draws(SamplingParams(temperature=1.0, seed=43))


def test_finish_reasons_and_validation() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    assert finish_reason(7, 1, p) == "stop"
    assert finish_reason(5, 3, p) == "length"
    assert finish_reason(5, 2, p) is None
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_kv_account_and_request_storage() -> None:
    kv = KVAccount.from_bytes(budget_bytes=10_000, bytes_per_token=100)
    assert kv.capacity_tokens == 100
    kv.reserve("a", 70)
    assert not kv.can_reserve(31) and kv.can_reserve(30)
    with pytest.raises(CapacityError):
        kv.check_fits_ever("b", 101)
    kv.release("a")
    assert kv.reserved_tokens == 0
    store = RequestKV(2, 4, num_kv_heads=1, head_dim=2, capacity_tokens=3)
    keys, _ = store.write(3, 0, torch.ones(1, 2, 2), torch.ones(1, 2, 2))
    assert keys.shape == (1, 2, 2) and store.length == 2
    with pytest.raises(CapacityError, match="overflow"):
        store.write(3, 2, torch.ones(1, 2, 2), torch.ones(1, 2, 2))


def test_engine_kv_usage_follows_reservation_use_and_release(tiny_llama: tuple[Path, Any]) -> None:
    engine = StageEngine(tiny_llama[0], kv_capacity_tokens=100)
    engine.add_request("a", SamplingParams(max_tokens=5), prompt_token_ids=[1, 2, 3])
    engine.add_request("b", SamplingParams(max_tokens=55), prompt_token_ids=[4] * 40)
    assert engine.kv_usage().reserved_tokens == 0  # reserved at admission, i.e. at the first step
    engine.step()
    usage = engine.kv_usage()
    assert (usage.reserved_tokens, usage.num_requests, usage.used_tokens) == (8, 1, 3)  # b (95) waits
    while engine.has_request("a"):
        engine.step()
    engine.step()
    assert engine.kv_usage().reserved_tokens == 95
    engine.cancel("b")
    assert engine.kv_usage().reserved_tokens == 0 and not engine.has_unfinished
