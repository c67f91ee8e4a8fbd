"""Workloads: request lengths, arrival processes, and trace files.

* :class:`LengthSampler` — ``azure-conv``: truncated log-normal prompt and output lengths
  whose means match the Azure conversation trace the Helix paper used (prompt ≈ 763 tokens,
  ≤ 2048; output ≈ 232 tokens, ≤ 1024), ``fixed:P,O`` and ``uniform:P0-P1,O0-O1``.
* :func:`arrival_times` — Poisson (``cv = 1``) or bursty Gamma (``cv > 1``) inter-arrivals.
* :func:`load_trace` — replay a user's trace: CSV (``arrival_s,prompt_tokens,output_tokens``,
  header optional) or JSON lines with those keys.

Everything is deterministic for a given seed (numpy ``default_rng``).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from helix.errors import ConfigError

AZURE_PROMPT = (763.0, 2048, 1.0)  # mean, max, log-normal sigma
AZURE_OUTPUT = (232.0, 1024, 0.9)


@dataclass(slots=True, frozen=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _truncated_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    mass = _phi(b) - _phi(a)
    return math.exp(mu + sigma * sigma / 2) * (_phi(b - sigma) - _phi(a - sigma)) / mass


def _mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float:
    lo_mu, hi_mu = math.log(lo) - 5 * sigma, math.log(hi) + 5 * sigma
    for _ in range(100):
        mid = (lo_mu + hi_mu) / 2
        if _truncated_lognormal_mean(mid, sigma, lo, hi) < mean:
            lo_mu = mid
        else:
            hi_mu = mid
    return (lo_mu + hi_mu) / 2


class LengthSampler:
    """Prompt/output token lengths from a named distribution."""

    def __init__(self, spec: str = "azure-conv", seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.spec = spec
        self._buf: list[tuple[int, int]] = []
        if spec == "azure-conv":
            self._kind = "lognormal"
            self._params = [
                (_mu_for_mean(m + 0.5, s, 1.0, hi + 1.0), s, hi) for m, hi, s in (AZURE_PROMPT, AZURE_OUTPUT)
            ]
        elif spec.startswith("fixed:"):
            self._kind = "fixed"
            try:
                p, o = (int(x) for x in spec[6:].split(","))
            except ValueError:
                raise ConfigError("expected fixed:PROMPT,OUTPUT", field="--lengths") from None
            self._fixed = (p, o)
        elif spec.startswith("uniform:"):
            self._kind = "uniform"
            try:
                parts = [tuple(int(v) for v in r.split("-")) for r in spec[8:].split(",")]
                (p0, p1), (o0, o1) = parts  # type: ignore[misc]
            except ValueError:
                raise ConfigError("expected uniform:P0-P1,O0-O1", field="--lengths") from None
            self._uniform = (p0, p1, o0, o1)
        else:
            raise ConfigError(f"unknown length distribution {spec!r} (azure-conv, fixed:P,O, uniform:...)", field="--lengths")

    def _refill(self, n: int = 4096) -> None:
        if self._kind == "fixed":
            self._buf = [self._fixed] * n
            return
        if self._kind == "uniform":
            p0, p1, o0, o1 = self._uniform
            ps = self.rng.integers(p0, p1 + 1, n)
            os_ = self.rng.integers(o0, o1 + 1, n)
        else:
            cols = []
            for mu, sigma, hi in self._params:
                x = np.empty(0)
                while x.size < n:  # rejection-sample the truncation [1, hi]
                    draw = self.rng.lognormal(mu, sigma, 2 * n)
                    x = np.concatenate([x, draw[(draw >= 1.0) & (draw < hi + 1.0)]])
                cols.append(np.floor(x[:n]).astype(int))
            ps, os_ = cols
        self._buf = list(zip(ps.tolist(), os_.tolist(), strict=True))[::-1]

    def sample(self) -> tuple[int, int]:
        if not self._buf:
            self._refill()
        return self._buf.pop()


def arrival_times(rate_per_s: float, duration_s: float, *, cv: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival instants in ``[0, duration_s)``: Poisson when ``cv == 1``, Gamma-bursty when > 1."""
    if rate_per_s <= 0:
        raise ConfigError("the arrival rate must be positive", field="--rate")
    rng = np.random.default_rng(seed + 7919)
    n = int(rate_per_s * duration_s * 1.5) + 64
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate_per_s * shape), n)
    t = np.cumsum(gaps)
    while t[-1] < duration_s:
        more = np.cumsum(rng.gamma(shape, 1.0 / (rate_per_s * shape), n)) + t[-1]
        t = np.concatenate([t, more])
    return t[t < duration_s].tolist()


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Read a trace file (CSV or JSON lines) into request specs sorted by arrival."""
    p = Path(path)
    if not p.exists():
        raise ConfigError("file not found", source=str(p))
    out: list[RequestSpec] = []
    text = p.read_text()
    i = 0
    try:
        if p.suffix in (".jsonl", ".json"):
            for i, line in enumerate(text.splitlines()):  # noqa: B007 - i names the bad line
                if line.strip():
                    d = json.loads(line)
                    out.append(RequestSpec(float(d["arrival_s"]), int(d["prompt_tokens"]), int(d["output_tokens"])))
        else:
            for i, row in enumerate(csv.reader(text.splitlines())):
                if not row or (i == 0 and not row[0].replace(".", "", 1).strip().isdigit()):
                    continue
                out.append(RequestSpec(float(row[0]), int(row[1]), int(row[2])))
    except (KeyError, ValueError, IndexError, json.JSONDecodeError) as exc:
        raise ConfigError(f"line {i + 1}: expected arrival_s, prompt_tokens, output_tokens ({exc})", source=str(p)) from None
    for r in out:
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ConfigError("prompt_tokens and output_tokens must be ≥ 1", source=str(p))
    out.sort(key=lambda r: r.arrival_s)
    return out
