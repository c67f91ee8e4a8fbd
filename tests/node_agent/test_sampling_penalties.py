"""Presence/frequency penalties and logit bias in the last stage's sampler, against values computed
by hand (OpenAI's formula: ``logits[t] += bias[t] - presence * (count[t] > 0) - frequency * count[t]``
over the tokens generated so far), and the failover case: a sampler rebuilt with the tokens
generated before a re-prefill continues exactly like the one that was never interrupted."""

from __future__ import annotations

import pytest
import torch

from helix.errors import RequestError
from node_agent.sampling import RequestSampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.9, 0.5, 2.0])


def _greedy(params: SamplingParams, steps: int) -> list[int]:
    sampler = RequestSampler(params, vocab_size=LOGITS.numel())
    return [sampler.sample(LOGITS) for _ in range(steps)]


def test_adjusted_logits_match_the_hand_computed_values() -> None:
    # generated so far: token 1 twice, token 4 once; bias +10 on token 3, -1 on token 0
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, -1.0), (3, 10.0)),
                            prior_output_ids=(1, 4, 1))
    out = RequestSampler(params, vocab_size=5).adjusted(LOGITS)
    # t0: 1 - 1 = 0; t1: 3 - 0.5 - 2*0.25 = 2; t2 untouched; t3: 0.5 + 10; t4: 2 - 0.5 - 0.25
    assert out.tolist() == pytest.approx([0.0, 2.0, 2.9, 10.5, 1.25])
    assert LOGITS.tolist() == pytest.approx([1.0, 3.0, 2.9, 0.5, 2.0])  # the model's row is not modified
    negative = RequestSampler(SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0, prior_output_ids=(3, 3)), 5)
    assert negative.adjusted(LOGITS).tolist() == pytest.approx([1.0, 3.0, 2.9, 0.5 + 0.5 + 2.0, 2.0])


def test_frequency_penalty_greedy_sequence_by_hand() -> None:
    # f = 0.6, every pick lowers its token by 0.6: 3.0 | 2.9 | 2.4 | 2.3 | 2.0 | 1.8 | 1.7 | 1.4 | 1.2 | 1.1 | 1.0
    assert _greedy(SamplingParams(frequency_penalty=0.6), 11) == [1, 2, 1, 2, 4, 1, 2, 4, 1, 2, 0]
    assert _greedy(SamplingParams(), 4) == [1, 1, 1, 1]  # no penalty: the same token forever


def test_presence_penalty_applies_once_per_token() -> None:
    # p = 1.5: 1 (-> 1.5), 2 (-> 1.4), 4 (-> 0.5), then token 1 at 1.5 beats 1.0 and is not lowered again
    assert _greedy(SamplingParams(presence_penalty=1.5), 6) == [1, 2, 4, 1, 1, 1]


def test_logit_bias_forces_or_bans_a_token_when_sampling_too() -> None:
    assert _greedy(SamplingParams(logit_bias=((3, 100.0),)), 3) == [3, 3, 3]
    assert 1 not in _greedy(SamplingParams(logit_bias=((1, -100.0),)), 5)
    forced = RequestSampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((0, 100.0),)), vocab_size=5)
    assert {forced.sample(LOGITS) for _ in range(200)} == {0}
    banned = RequestSampler(SamplingParams(temperature=2.0, seed=3, logit_bias=((1, -100.0), (2, -100.0))), 5)
    draws = {banned.sample(LOGITS) for _ in range(500)}
    assert draws <= {0, 3, 4} and len(draws) > 1


def test_a_rebuilt_sampler_continues_like_the_uninterrupted_one() -> None:
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.6)
    whole = _greedy(params, 12)
    for cut in (1, 5, 9):  # a failover after `cut` tokens: the new pipeline gets them as prior_output_ids
        resumed = RequestSampler(SamplingParams(presence_penalty=0.3, frequency_penalty=0.6,
                                                prior_output_ids=tuple(whole[:cut])), vocab_size=5)
        assert whole[:cut] + [resumed.sample(LOGITS) for _ in range(12 - cut)] == whole
    forgetful = RequestSampler(params, vocab_size=5)  # without them the counts restart: another output
    assert whole[:5] + [forgetful.sample(LOGITS) for _ in range(7)] != whole


def test_bad_values_are_request_errors_naming_the_field() -> None:
    with pytest.raises(RequestError, match="presence_penalty must be in \\[-2, 2\\]") as info:
        SamplingParams(presence_penalty=2.5)
    assert info.value.param == "presence_penalty"
    with pytest.raises(RequestError, match="frequency_penalty") as info:
        SamplingParams(frequency_penalty=-3)
    assert info.value.param == "frequency_penalty"
    with pytest.raises(RequestError, match="logit_bias of token 4 must be in \\[-100, 100\\]") as info:
        SamplingParams(logit_bias=((4, 150.0),))
    assert info.value.param == "logit_bias"
    with pytest.raises(RequestError, match="token id 5, outside the vocabulary \\[0, 5\\)") as info:
        RequestSampler(SamplingParams(logit_bias=((1, 1.0), (5, 1.0))), vocab_size=5)
    assert info.value.param == "logit_bias"
    with pytest.raises(RequestError, match="prior output token id 7") as info:
        RequestSampler(SamplingParams(frequency_penalty=1.0, prior_output_ids=(7,)), vocab_size=5)
    assert info.value.param == "prior_output_ids"
