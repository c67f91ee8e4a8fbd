"""JSON mode and structured outputs on the coordinator: a ``response_format`` becomes a grammar.

This module owns the coordinator's use of ``llguidance`` (``node_agent.grammar`` owns it on the
agents). It compiles a JSON schema - or, for JSON mode, "any JSON object" - into llguidance's
grammar, a JSON string that travels to the agent holding the last layer in
``SamplingSpec.grammar``, and checks it here, before the request is admitted, so a bad schema is a
400 rather than a failure on an agent. The check needs no tokenizer: it parses the schema, rejects
keywords llguidance does not implement (``not``, ``uniqueItems``, unknown ``format`` values ...)
and schemas no JSON value can satisfy.

Whitespace: the grammar allows none between JSON tokens except after ``,`` and ``:`` (one space
each, as in ``json.dumps``). Small models left free to emit whitespace inside a JSON value tend to
emit it until ``max_tokens``. A schema's ``x-guidance`` block (llguidance's JSON options) can
override this.
"""

from __future__ import annotations

import json
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class SchemaError(ValueError):
    """A JSON schema llguidance cannot turn into a grammar (the message says why)."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar (a JSON string) for JSON text that matches ``schema``; a
    :class:`SchemaError` saying why when llguidance cannot enforce it."""
    try:
        text = json.dumps(schema, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"not a JSON schema: {exc}") from exc
    return _compiled(text)


@lru_cache(maxsize=256)  # clients send the same few schemas again and again
def _compiled(schema: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise SchemaError(f"not a JSON schema: {exc}") from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(f"the JSON schema cannot be enforced: {'; '.join(messages)}")
    return grammar


@cache
def json_object_grammar() -> str:
    """The grammar of JSON mode: any JSON object."""
    return json_schema_grammar(ANY_JSON_OBJECT)
