"""Structured output on the last stage: llguidance matchers over the model's own tokenizer.

This module owns the agents' use of ``llguidance`` (``router.structured_output`` owns it on the
coordinator, which compiles a request's ``response_format`` into the grammar that
``SamplingParams.grammar`` carries). A grammar constrains text, while an agent sees only token
ids, so llguidance needs the vocabulary: the model dir's ``tokenizer.json`` (the GGUF converter
writes it beside the converted weights, ``helix.gguf_tokenizer``; a Hugging Face dir ships it).
:class:`GrammarTokenizer` reads it once per engine, on the first request that has a grammar.

A :class:`GrammarMatcher` follows one request: :meth:`~GrammarMatcher.allowed` says which tokens
may come next, :meth:`~GrammarMatcher.consume` moves past the sampled one, and
:attr:`~GrammarMatcher.done` says when the grammar admits nothing more (the JSON is complete).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from llguidance import LLMatcher, LLTokenizer

from helix.errors import RequestError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, loaded from ``<model_dir>/tokenizer.json``
    on first use (about a second for a 49k vocabulary) and kept."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.path = Path(model_dir) / TOKENIZER_FILE
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None

    def matcher(self, grammar: str, prior_output_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for ``grammar`` that has consumed ``prior_output_ids`` already."""
        return GrammarMatcher(self._load(), self.vocab_size, grammar, prior_output_ids)

    def _load(self) -> LLTokenizer:
        if self._tokenizer is None:
            if not self.path.is_file():
                raise RequestError(f"{self.path} not found: this agent cannot follow a response_format grammar "
                                   "without its model's tokenizer (a dir converted from a GGUF has it; copy it "
                                   "from the model's Hugging Face repository)", param="response_format")
            try:
                self._tokenizer = LLTokenizer(self.path.read_text(), n_vocab=self.vocab_size,
                                              eos_token=self.eos_token_ids or None)
            except (ValueError, RuntimeError) as exc:
                raise RequestError(f"{self.path}: llguidance cannot read this tokenizer: {exc}",
                                   param="response_format") from exc
            log.info("loaded %s for grammar-constrained sampling", self.path)
        return self._tokenizer


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int, grammar: str, prior_output_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise RequestError(f"the grammar is invalid: {self._matcher.get_error()}", param="response_format")
        if prior_output_ids and not self._matcher.consume_tokens(list(prior_output_ids)):
            raise RequestError(f"the tokens generated before the re-prefill do not follow the grammar: "
                               f"{self._matcher.get_error()}", param="prior_output_ids")

    def allowed(self) -> torch.Tensor:
        """A ``[vocab_size]`` bool row: the tokens the grammar allows next (end-of-sequence
        tokens only where the grammar may end)."""
        bias = bytearray(self._matcher.compute_logit_bias())  # one byte per token: 0 = forbidden
        return torch.frombuffer(bias, dtype=torch.uint8)[: self.vocab_size] != 0

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete match (the request may end here)."""
        return self._matcher.is_accepting()

    def consume(self, token: int) -> None:
        """Move past ``token`` (one :meth:`allowed` allowed). A forbidden token ends the matcher in
        an error state, which :attr:`done` reports, so the request stops rather than run on free."""
        if not self._matcher.consume_token(token):
            log.warning("token %d does not follow the grammar: %s", token, self._matcher.get_error())

    @property
    def done(self) -> bool:
        """Whether the grammar admits no further token (complete, or broken)."""
        return self._matcher.is_stopped()
