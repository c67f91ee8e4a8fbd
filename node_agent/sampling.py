"""Sampling parameters and the per-request token sampler (greedy, temperature, top-k, top-p, seed).

Sampling happens only on the stage that holds the last layer. Each request owns a
``torch.Generator`` seeded from ``SamplingParams.seed`` so its draws do not depend on which other
requests share the step. Stop conditions (stop token, ``max_tokens``) are decided here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helix.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    return_logits: bool = False  # attach the sampled row's logits to the output (tests, debugging)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")


NUCLEUS_CANDIDATES = 1024


def make_generator(params: SamplingParams) -> torch.Generator:
    """A per-request generator: seeded when ``params.seed`` is set, else from OS entropy."""
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


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


def finish_reason(token: int, num_generated: int, params: SamplingParams) -> str | None:
    """``"stop"`` on a stop token, ``"length"`` at ``max_tokens``, else ``None`` (keep going)."""
    if token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
