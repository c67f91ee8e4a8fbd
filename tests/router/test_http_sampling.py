"""Penalties and logit bias end to end: the ``openai`` client -> HTTP -> coordinator -> wire -> the
agent that samples (real agents, SmolLM2-135M), checked against ``transformers``' greedy decoding
with the same penalties applied by hand (OpenAI's formula over the tokens generated so far)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

MODEL = "smollm2-135m"
REPETITIVE = "one, one, one, one, one, one, one,"


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaForCausalLM

    from node_agent.gguf_convert import cached_model_dir

    torch.set_num_threads(1)
    return LlamaForCausalLM.from_pretrained(cached_model_dir(), dtype=torch.float32).eval()


def hf_greedy_penalized(model: Any, prompt: list[int], max_tokens: int, stop_ids: frozenset[int], *,
                        presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """The reference: full forward passes, ``logits[t] -= presence * (n_t > 0) + frequency * n_t``
    over the generated tokens, argmax; stops after an end-of-sequence token."""
    ids, out = list(prompt), []
    counts = torch.zeros(model.config.vocab_size)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logits -= presence * (counts > 0).float() + frequency * counts
            token = int(torch.argmax(logits))
            out.append(token)
            if token in stop_ids:
                break
            counts[token] += 1
            ids.append(token)
    return out


def test_logit_bias_plus_100_makes_greedy_output_that_token(serving_cluster) -> None:
    client = serving_cluster.client()
    tokenizer = serving_cluster.coordinator.tokenizer
    (blue,) = tokenizer.encode(" blue")
    plain = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=5, temperature=0)
    assert " blue" not in plain.choices[0].text
    out = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=5, temperature=0,
                                    logit_bias={str(blue): 100})
    assert out.choices[0].text == " blue" * 5 and out.usage.completion_tokens == 5
    # -100 bans the token greedy picks first; the chat endpoint carries the bias too
    first = tokenizer.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[:1] != [first]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(blue): 100})
    assert chat.choices[0].message.content == " blue" * 3


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 1.0), (1.5, 0.2)])
def test_penalties_change_repetitive_greedy_output_as_the_reference_predicts(serving_cluster, hf_model, presence,
                                                                             frequency) -> None:
    client = serving_cluster.client()
    tokenizer = serving_cluster.coordinator.tokenizer
    prompt = tokenizer.encode(REPETITIVE)
    stops = tokenizer.eos_token_ids
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert plain == tokenizer.decode(hf_greedy_penalized(hf_model, prompt, 16, stops))  # the reference is sound
    expected = tokenizer.decode(hf_greedy_penalized(hf_model, prompt, 16, stops, presence=presence,
                                                    frequency=frequency))
    assert expected != plain  # the penalty changes the repetitive answer
    stage_counts = set()  # the sampling stage learns the penalties from ADMIT (alone) or ACTIVATIONS (hand-off)
    for _ in range(8):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                        presence_penalty=presence, frequency_penalty=frequency)
        assert out.choices[0].text == expected
        stage_counts.add(len(out.model_extra["helix"]["pipelines"][0]))
        if len(stage_counts) > 1:
            break
    assert stage_counts == {1, 2}
