"""Grammar-constrained sampling in the last stage's sampler (JSON mode, structured outputs) with the
real SmolLM2 tokenizer and llguidance: whatever the logits say, the picked tokens spell JSON that
matches the schema, the request stops when the JSON is complete, stop tokens wait for a complete
match, and a sampler rebuilt after a failover (``prior_output_ids``) continues the same output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from helix.errors import RequestError
from helix.smollm2 import smollm2_gguf_path
from node_agent.grammar import GrammarTokenizer
from node_agent.sampling import RequestSampler, SamplingParams, finish_reason
from router.structured_output import json_object_grammar, json_schema_grammar
from router.tokenizer import ChatTokenizer, write_tokenizer_files

VOCAB = 49152
STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>: what the coordinator sends for SmolLM2
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["user", "owner", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's ``tokenizer.json``, written from its GGUF the way the coordinator writes it."""
    return write_tokenizer_files(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2-tokenizer"))


@pytest.fixture(scope="module")
def grammars(tokenizer_dir: Path) -> GrammarTokenizer:
    return GrammarTokenizer(tokenizer_dir, VOCAB, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def text(tokenizer_dir: Path) -> Any:
    return ChatTokenizer.from_dir(tokenizer_dir).decode


def logits_at(step: int) -> torch.Tensor:
    """A stand-in model: the same random logits row for a given step, every run."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step))


def generate(sampler: RequestSampler, first_step: int = 0, *, tilt: torch.Tensor | None = None) -> tuple[list[int], str]:
    """Sample until a finish reason, from step ``first_step`` (the tokens before it were generated
    elsewhere); ``tilt`` is added to every logits row."""
    ids: list[int] = []
    for step in range(first_step, sampler.params.max_tokens):
        row = logits_at(step) if tilt is None else logits_at(step) + tilt
        token = sampler.sample(row)
        ids.append(token)
        reason = finish_reason(token, step + 1, sampler.params, grammar_done=sampler.grammar_done)
        if reason:
            return ids, reason
    raise AssertionError("no finish reason by max_tokens")


def outside_strings(json_text: str) -> str:
    """``json_text`` without its string literals (what the grammar's whitespace rules govern)."""
    out, in_string, escaped = [], False, False
    for ch in json_text:
        if in_string:
            in_string, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            in_string = True
        else:
            out.append(ch)
    return "".join(out)


def schema_params(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=300, stop_token_ids=STOP_IDS, grammar=json_schema_grammar(SCHEMA), **kw)


def test_greedy_output_is_json_matching_the_schema_and_stops_when_complete(grammars, text) -> None:
    ids, reason = generate(RequestSampler(schema_params(), VOCAB, grammars))
    value = json.loads(text(ids))
    jsonschema.validate(value, SCHEMA)
    assert reason == "stop" and not set(ids) & set(STOP_IDS)  # stopped on the closing brace, no EOS needed
    assert text(ids).startswith('{"name": "')  # the grammar's separators: ", " and ": ", no other whitespace
    # the unconstrained argmax of these logits is something else entirely
    assert [int(torch.argmax(logits_at(i))) for i in range(3)] != ids[:3]


def test_sampling_with_temperature_stays_inside_the_schema(grammars, text) -> None:
    for seed in (1, 2, 3):
        ids, reason = generate(RequestSampler(schema_params(temperature=1.0, top_p=0.9, seed=seed), VOCAB, grammars))
        jsonschema.validate(json.loads(text(ids)), SCHEMA)
        assert reason == "stop"


def test_end_of_sequence_and_whitespace_wait_for_the_grammar(grammars, text) -> None:
    """A model that wants to stop at once or to emit newlines (small models do, inside JSON) still
    produces complete, compact JSON: the mask forbids both until the grammar allows them."""
    tilt = torch.zeros(VOCAB)
    newline, space = (ChatTokenizer.from_dir(grammars.path.parent).encode(s)[0] for s in ("\n", "  "))
    tilt[list(STOP_IDS)] = 100.0
    tilt[[newline, space]] = 50.0
    sampler = RequestSampler(schema_params(), VOCAB, grammars)
    first = sampler.masked(logits_at(0) + tilt)
    assert torch.isinf(first[list(STOP_IDS)]).all() and torch.isinf(first[[newline, space]]).all()
    allowed = torch.isfinite(first).nonzero().flatten().tolist()
    assert allowed and all(text([t]).startswith("{") for t in allowed)
    ids, reason = generate(sampler, tilt=tilt)
    out = text(ids)
    jsonschema.validate(json.loads(out), SCHEMA)
    structure = outside_strings(out)
    assert "\n" not in structure and "  " not in structure and reason == "stop"
    assert structure.replace(", ", "").replace(": ", "").count(" ") == 0

    # JSON mode: a model that wants EOS first and a closing brace next writes the shortest object,
    # and the request stops on its last brace (the grammar allows nothing after it)
    closing = ChatTokenizer.from_dir(grammars.path.parent).encode("}")[0]
    tilt[closing] = 50.0
    eos_first = RequestSampler(SamplingParams(max_tokens=50, stop_token_ids=STOP_IDS, grammar=json_object_grammar()),
                               VOCAB, grammars)
    obj, reason = generate(eos_first, tilt=tilt)
    assert reason == "stop" and text(obj) == "{}" and not set(obj) & set(STOP_IDS)


def test_a_rebuilt_sampler_continues_the_same_constrained_output(grammars, text) -> None:
    whole, reason = generate(RequestSampler(schema_params(), VOCAB, grammars))
    assert reason == "stop" and len(whole) > 10
    for cut in (1, len(whole) // 2, len(whole) - 1):  # a failover after `cut` tokens
        resumed = RequestSampler(schema_params(prior_output_ids=tuple(whole[:cut])), VOCAB, grammars)
        rest, reason = generate(resumed, first_step=cut)
        assert whole[:cut] + rest == whole and reason == "stop"
    # without them the matcher starts over: the continuation is another JSON document, not this one's tail
    forgetful, _ = generate(RequestSampler(schema_params(), VOCAB, grammars), first_step=len(whole) // 2)
    assert text(forgetful).startswith("{")


def test_grammar_problems_are_request_errors_naming_the_field(tmp_path: Path, grammars) -> None:
    grammar = json_object_grammar()
    with pytest.raises(RequestError, match="tokenizer.json not found") as info:
        RequestSampler(SamplingParams(grammar=grammar), VOCAB, GrammarTokenizer(tmp_path, VOCAB))
    assert info.value.param == "response_format"
    with pytest.raises(RequestError, match="no tokenizer") as info:
        RequestSampler(SamplingParams(grammar=grammar), VOCAB)
    assert info.value.param == "response_format"
    with pytest.raises(RequestError, match="the grammar is invalid") as info:
        RequestSampler(SamplingParams(grammar="start: ("), VOCAB, grammars)
    assert info.value.param == "response_format"
    not_json = ChatTokenizer.from_dir(grammars.path.parent).encode("Sure! {")
    with pytest.raises(RequestError, match="do not follow the grammar") as info:
        RequestSampler(SamplingParams(grammar=grammar, prior_output_ids=tuple(not_json)), VOCAB, grammars)
    assert info.value.param == "prior_output_ids"
