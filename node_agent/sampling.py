"""Sampling parameters and the per-request token sampler (greedy, temperature, top-k, top-p, seed,
presence/frequency penalties, logit bias, a grammar the output must follow).

Sampling happens only on the stage that holds the last layer. Each request owns a
:class:`RequestSampler`: a ``torch.Generator`` seeded from ``SamplingParams.seed`` (so its draws
do not depend on which other requests share the step) and, when a penalty is set, the counts of
the tokens it generated. Before a token is picked the logits are adjusted, OpenAI's way:
``logits[t] += logit_bias[t] - presence_penalty * (count[t] > 0) - frequency_penalty * count[t]``
(counts include ``prior_output_ids``, the tokens generated before a failover re-prefill). With a
``grammar`` (JSON mode, structured outputs) a :class:`~node_agent.grammar.GrammarMatcher` then
sets every token the grammar forbids to ``-inf`` and consumes the token picked; it consumes
``prior_output_ids`` first, so a re-prefilled request continues the same constrained output.
Stop conditions (stop token, the grammar complete, ``max_tokens``) are decided here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from helix.domain import FinishReason, token_finish
from helix.errors import RequestError
from helix.wire import MAX_LOGIT_BIAS, MAX_PENALTY

if TYPE_CHECKING:
    from node_agent.grammar import GrammarMatcher, GrammarTokenizer


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias in [-100, 100])
    prior_output_ids: tuple[int, ...] = field(default_factory=tuple)  # generated before a re-prefill
    grammar: str = ""  # an llguidance grammar the output follows (empty: none)
    return_logits: bool = False  # attach the sampled row's logits (as the model gave them) to the output
    paced: bool = False  # a request the engine runs whole waits for push_token instead of feeding its token back

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", param=name)
        for token, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                   f"{MAX_LOGIT_BIAS:g}], got {bias}", param="logit_bias")

    @property
    def penalized(self) -> bool:
        """Whether the tokens generated so far change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty)


NUCLEUS_CANDIDATES = 1024


def make_generator(params: SamplingParams) -> torch.Generator:
    """A per-request generator: seeded when ``params.seed`` is set, else from OS entropy."""
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


class RequestSampler:
    """One request's token picker on the last stage: its generator, its logit bias, the counts of
    the tokens it generated (kept only when a penalty is set) and its grammar matcher (with a
    grammar; ``grammars`` reads the vocabulary for it)."""

    __slots__ = ("params", "generator", "grammar", "_counts", "_bias_ids", "_bias", "_stop_ids")

    def __init__(self, params: SamplingParams, vocab_size: int, grammars: GrammarTokenizer | None = None) -> None:
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                               param="logit_bias")
        bad = [t for t in params.prior_output_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prior output token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                               param="prior_output_ids")
        self.params = params
        self.generator = make_generator(params)
        self._counts: torch.Tensor | None = None
        if params.penalized:
            self._counts = torch.bincount(torch.tensor(params.prior_output_ids, dtype=torch.long),
                                          minlength=vocab_size).float()
        self._bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self._bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self._stop_ids = torch.tensor([t for t in params.stop_token_ids if 0 <= t < vocab_size], dtype=torch.long)
        self.grammar: GrammarMatcher | None = None
        if params.grammar:
            if grammars is None:
                raise RequestError("this stage cannot follow a grammar (no tokenizer)", param="response_format")
            self.grammar = grammars.matcher(params.grammar, params.prior_output_ids)

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (a ``[vocab]`` row) with the logit bias and the penalties applied (a new tensor
        when anything applies; ``logits`` itself otherwise)."""
        if self._counts is None and not self._bias.numel():
            return logits
        out = logits.float().clone()
        if self._bias.numel():
            out.index_add_(0, self._bias_ids, self._bias)
        if self._counts is not None:
            p = self.params
            out -= p.presence_penalty * (self._counts > 0).float() + p.frequency_penalty * self._counts
        return out

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar forbids next at ``-inf`` (a new tensor). The
        request's stop tokens are allowed exactly where the grammar may end."""
        assert self.grammar is not None
        allowed = self.grammar.allowed()
        if self._stop_ids.numel():
            allowed[self._stop_ids] = self.grammar.accepting
        return logits.masked_fill(~allowed, float("-inf"))

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from a ``[vocab]`` logits row, count it and move the grammar past it."""
        scores = self.adjusted(logits)
        if self.grammar is not None:
            scores = self.masked(scores)
        token = sample_token(scores, self.params, self.generator)
        if self._counts is not None:
            self._counts[token] += 1
        if self.grammar is not None and token not in self.params.stop_token_ids:
            self.grammar.consume(token)
        return token

    @property
    def grammar_done(self) -> bool:
        """Whether the request has a grammar that admits no further token."""
        return self.grammar is not None and self.grammar.done


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id from a ``[vocab]`` logits row."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        return _sample_nucleus(torch.softmax(scores, dim=-1), params.top_p, generator)
    # inverse CDF with one uniform draw: the same distribution as torch.multinomial, ~10x
    # cheaper on CPU (multinomial draws an exponential per vocabulary entry)
    return _inverse_cdf(torch.softmax(scores, dim=-1), generator)


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Index drawn from the (unnormalized) ``probs`` with one uniform draw."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)


def _sample_nucleus(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """Top-p: draw among the most likely tokens whose mass reaches ``top_p`` (the token that
    crosses it included). Sorting the whole vocabulary costs ~6 ms per request on CPU; the
    nucleus almost always lies within the top ``NUCLEUS_CANDIDATES``, which is checked, with a
    full sort when it does not."""
    top, order = torch.topk(probs, min(NUCLEUS_CANDIDATES, probs.numel()))
    if top.numel() < probs.numel() and float(top.sum()) < top_p:
        top, order = torch.sort(probs, descending=True)
    keep = int(((top.cumsum(0) - top) < top_p).sum())
    return int(order[_inverse_cdf(top[: max(1, keep)], generator)])


def finish_reason(token: int, num_generated: int, params: SamplingParams, *,
                  grammar_done: bool = False) -> FinishReason | None:
    """``"stop"`` on a stop token or once the grammar is complete, ``"length"`` at ``max_tokens``,
    else ``None`` (keep going)."""
    if grammar_done:
        return FinishReason.STOP
    return token_finish(token, num_generated, params.max_tokens, params.stop_token_ids)
