"""Random tiny Llamas: stage splits and partial layer sub-ranges reproduce ``transformers`` logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from node_agent.backends import StageBackend
from node_agent.engine import StageEngine
from node_agent.pipeline import LocalPipeline
from node_agent.sampling import SamplingParams
from node_agent.scheduler import SchedulerConfig

ATOL = 2e-3  # float32, logits of magnitude ~10: summation order differs from transformers
SPLITS = [[(0, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 2), (2, 4)]]
CHUNKED = SchedulerConfig(max_batch_size=4, token_budget=9, chunk_size=5)
# every stage runs on our torch engine, or on vLLM's layers (those run in .venv-vllm: `-m vllm`)
BACKENDS = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 7, 13, 22)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", SPLITS, ids=["1-stage", "3-stages", "2-stages"])
def test_split_pipeline_logits_match_transformers(tiny_llama: tuple[Path, Any], split: list[tuple[int, int]],
                                                 attention_path: str, backend: str) -> None:
    model_dir, hf = tiny_llama
    pipe = LocalPipeline([StageEngine(model_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=256,
                                      backend=StageBackend(backend)) for a, b in split])  # fmt: skip
    _check_logits(pipe, hf)


def _check_logits(pipe: LocalPipeline, hf: Any, atol: float = ATOL) -> None:
    """Four prompts through ``pipe`` at once: the logits of every generated token are transformers'."""
    prompts = _prompts(hf.config.vocab_size)
    for i, prompt in enumerate(prompts):
        pipe.add_request(str(i), prompt, SamplingParams(max_tokens=6, return_logits=True))
    outs: dict[str, list[Any]] = {str(i): [] for i in range(len(prompts))}
    while pipe.has_unfinished:
        for out in pipe.step():
            outs[out.request_id].append(out)
    for i, prompt in enumerate(prompts):
        generated = [o.token for o in outs[str(i)]]
        assert len(generated) == 6
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + generated])).logits[0]
        ours = torch.stack([o.logits for o in outs[str(i)]])
        torch.testing.assert_close(ours, ref[len(prompt) - 1: len(prompt) + 5], atol=atol, rtol=1e-3)
        assert generated == ref[len(prompt) - 1: len(prompt) + 5].argmax(-1).tolist()


def _hf_hidden(hf: Any, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states) + (out.logits[0],)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 3])
def test_partial_sub_ranges_inside_a_stage(tiny_llama: tuple[Path, Any], chunk: int | None,
                                           attention_path: str, backend: str) -> None:
    """One stage [0, 4) serves requests running [1, 3), [0, 2), [2, 4) and [0, 4) in the same steps."""
    model_dir, hf = tiny_llama
    sched = SchedulerConfig(max_batch_size=4, token_budget=64, chunk_size=chunk)
    engine = StageEngine(model_dir, 0, 4, scheduler=sched, kv_capacity_tokens=512, backend=StageBackend(backend))
    ids = _prompts(hf.config.vocab_size)[3]
    hidden = _hf_hidden(hf, ids)  # hidden[l] = input of layer l; hidden[4] is normed; hidden[5] = logits
    sampling = SamplingParams(max_tokens=1, return_logits=True)
    engine.add_request("mid", sampling, prompt_len=len(ids), layer_range=(1, 3))
    engine.add_request("head", sampling, prompt_token_ids=ids, layer_range=(0, 2))
    engine.add_request("tail", sampling, prompt_len=len(ids), layer_range=(2, 4))
    engine.add_request("full", sampling, prompt_token_ids=ids)
    engine.push_hidden("mid", hidden[1])
    engine.push_hidden("tail", hidden[2])
    got: dict[str, list[Any]] = {}
    while engine.has_unfinished:
        for out in engine.step().outputs:
            got.setdefault(out.request_id, []).append(out)
            if out.request_id in ("mid", "head") and sum(o.num_tokens for o in got[out.request_id]) == len(ids):
                engine.cancel(out.request_id)  # a non-last range ends when its prompt is through
    torch.testing.assert_close(torch.cat([o.hidden for o in got["mid"]]), hidden[3], atol=ATOL, rtol=1e-3)
    torch.testing.assert_close(torch.cat([o.hidden for o in got["head"]]), hidden[2], atol=ATOL, rtol=1e-3)
    for name in ("tail", "full"):
        assert got[name][-1].token is not None
        torch.testing.assert_close(got[name][-1].logits, hidden[5][-1], atol=ATOL, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stage_loads_only_its_layers(tiny_llama: tuple[Path, Any], backend: str) -> None:
    model_dir, _ = tiny_llama
    middle: Any = StageEngine(model_dir, 1, 3, backend=StageBackend(backend)).model
    assert sorted(middle.layers) == [1, 2]
    assert middle.embed_tokens is None and middle.lm_head is None
    last: Any = StageEngine(model_dir, 3, 4, backend=StageBackend(backend)).model
    assert last.lm_head is not None and last.embed_tokens is None
    if backend == "vllm":  # vLLM built only the stage's layers (PPMissingLayer elsewhere) and loaded only theirs
        built = [type(layer).__name__ for layer in middle._model.model.layers]
        assert built == ["PPMissingLayer", "LlamaDecoderLayer", "LlamaDecoderLayer", "PPMissingLayer"]
        assert all(type(layer.self_attn.attn).__name__ == "HelixAttention" for layer in middle.layers.values())
        # on CPU the norms and the activation run the native kernels (vLLM's CPU build has none)
        assert {type(m).__name__ for layer in middle.layers.values()
                for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn)} == {
            "NativeRMSNorm", "NativeSiluAndMul"}
        assert type(last.final_norm).__name__ == "NativeRMSNorm"


@pytest.mark.vllm
def test_mixed_torch_and_vllm_stages_feed_each_other(tiny_llama: tuple[Path, Any]) -> None:
    """torch [0, 1) -> vLLM [1, 3) -> torch [3, 4): one hidden stream on the seam, transformers' logits."""
    model_dir, hf = tiny_llama
    stages = [(0, 1, "torch"), (1, 3, "vllm"), (3, 4, "torch")]
    _check_logits(LocalPipeline([StageEngine(model_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=256,
                                             backend=StageBackend(name)) for a, b, name in stages]), hf)
    vllm_first = [(0, 2, "vllm"), (2, 4, "torch")]
    _check_logits(LocalPipeline([StageEngine(model_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=256,
                                             backend=StageBackend(name)) for a, b, name in vllm_first]), hf)


def test_seeded_sampling_does_not_depend_on_split_or_batch(tiny_llama: tuple[Path, Any]) -> None:
    model_dir, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size)
    runs = []
    for split, others in (([(0, 4)], False), ([(0, 1), (1, 3), (3, 4)], True)):
        pipe = LocalPipeline([StageEngine(model_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=256)
                              for a, b in split])
        pipe.add_request("s", prompts[2], SamplingParams(max_tokens=8, temperature=1.3, top_p=0.9, seed=11))
        if others:  # batch-mates change the step composition, not the seeded draws
            for i in (0, 3):
                pipe.add_request(str(i), prompts[i], SamplingParams(max_tokens=5, temperature=1.0))
        tokens = []
        while pipe.has_unfinished:
            tokens += [o.token for o in pipe.step() if o.request_id == "s"]
        runs.append(tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 8


def test_a_step_reports_what_it_ran_by_entry_layer(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    """StepResult.by_start (and the agent's step log written from it): prefill tokens, decodes and
    their context per first layer, the composition the simulator prices an iteration by."""
    from node_agent.step_log import StepLog, read_step_log

    model_dir, _ = tiny_llama
    engine = StageEngine(model_dir, 0, 4, scheduler=SchedulerConfig(max_batch_size=4, token_budget=64, chunk_size=None),
                         kv_capacity_tokens=512)  # fmt: skip
    sampling = SamplingParams(max_tokens=3)
    engine.add_request("whole", sampling, prompt_token_ids=[5, 6, 7, 8, 9])
    engine.add_request("tail", sampling, prompt_len=4, layer_range=(2, 4))
    engine.push_hidden("tail", torch.randn(4, engine.config.hidden_size))
    log = StepLog(tmp_path / "steps.jsonl")
    first = log.run(engine.step)
    assert first.by_start == {0: (5, 0, 0), 2: (4, 0, 0)}
    engine.push_hidden("tail", torch.randn(1, engine.config.hidden_size))  # its next token's input
    second = log.run(engine.step)  # both decode: positions 5 and 4 attend over 6 and 5 tokens
    assert second.by_start == {0: (0, 1, 6), 2: (0, 1, 5)}
    log.close()
    records = read_step_log(tmp_path / "steps.jsonl")
    assert [r["by_start"] for r in records] == [first.by_start, second.by_start]
    assert all(r["cpu_ms"] > 0 and r["wall_ms"] > 0 for r in records)


def test_a_step_log_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    from helix.errors import ConfigError
    from node_agent.step_log import StepLog

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="step log") as err:
        StepLog(tmp_path / "a-file" / "steps.jsonl")  # its directory is a file
    assert err.value.field == "--step-log"
