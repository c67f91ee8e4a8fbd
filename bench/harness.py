"""Rounds, medians, spreads and verdicts: how every bench in ``bench/`` turns runs into a verdict.

A figure measured once on a shared machine is an anecdote: the same code gave 1.38x and 2.19x
on the engine bench. So every bench that names a target measures in rounds and judges the
median, the same way:

1. :func:`interleaved` / :func:`arm_order` give the order in which to run the arms of a
   comparison: forward in even rounds, reversed in odd ones (two arms: A,B | B,A | A,B | ...),
   so that the machine's drift over the run hits every arm alike.
2. Each round's figures go into a :class:`RoundLog`; a ratio is taken *within* each round
   (:meth:`RoundLog.ratio`), then summarized like any other figure: the median of the per-round
   ratios, never the ratio of medians.
3. :func:`figures_table` prints every figure's median, its spread (min-max over the rounds)
   and each round's value; :meth:`Verdict.line` states the verdict on the median with how many
   rounds pass, e.g. ``1.42x median (1.21-1.60), 4/5 rounds >= 1.3x -> PASS``.

:func:`add_rounds_option` gives every bench the same ``--rounds`` option. Only the pure parts
(order, spread, ratio, verdict) carry logic; they are unit-tested in
``tests/test_bench_harness.py`` with fabricated numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Op = Literal[">=", "<=", "within"]
_OP_TEXT = {">=": "≥", "<=": "≤"}


# ---- order -----------------------------------------------------------------------------------
def arm_order(arms: Sequence[T], round_index: int) -> list[T]:
    """The arms in the order round ``round_index`` (0-based) runs them: forward in even rounds,
    reversed in odd ones. Two arms run A,B | B,A | A,B | B,A (ABBA): a linear drift over an even
    number of rounds costs both arms the same."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


def interleaved(arms: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """Every (round index, arm) of a run of ``rounds`` rounds, in running order."""
    for r in range(rounds):
        for arm in arm_order(arms, r):
            yield r, arm


# ---- spread, ratio, target, verdict ------------------------------------------------------------
def format_value(x: float, unit: str = "") -> str:
    """A figure with about three significant digits and its unit (``×`` and ``%`` stick to it)."""
    if math.isnan(x):
        return "—"
    a = abs(x)
    text = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else f"{x:.3g}"
    if not unit:
        return text
    return f"{text}{unit}" if unit in ("×", "%") else f"{text} {unit}"


@dataclass(frozen=True, slots=True)
class Spread:
    """A figure over the rounds: its defined values and how many rounds left it undefined."""

    values: tuple[float, ...]
    missing: int = 0

    @property
    def rounds(self) -> int:
        return len(self.values) + self.missing

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def low(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def high(self) -> float:
        return max(self.values) if self.values else math.nan

    def describe(self, unit: str = "") -> str:
        """``1.42× (1.21–1.60)``: the median and the range; one value alone has no range."""
        med = format_value(self.median, unit)
        if len(self.values) < 2:
            return med
        return f"{med} ({format_value(self.low)}–{format_value(self.high)})"


def spread(values: Sequence[float | None]) -> Spread:
    """The spread of per-round values; ``None`` and NaN count as rounds where the figure was undefined."""
    defined = tuple(float(v) for v in values if v is not None and not math.isnan(v))
    return Spread(defined, len(values) - len(defined))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """One round's ratio; ``None`` when either side is undefined or the denominator is 0."""
    if numerator is None or denominator is None or math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator if denominator else None


@dataclass(frozen=True, slots=True)
class Target:
    """What a figure must reach: ``>= value``, ``<= value``, or ``within`` a relative tolerance of it."""

    op: Op
    value: float
    unit: str = "×"
    tolerance: float = 0.0  # "within": passes when |x - value| <= tolerance * |value|

    def passes(self, x: float | None) -> bool:
        if x is None or math.isnan(x):
            return False
        if self.op == ">=":
            return x >= self.value
        if self.op == "<=":
            return x <= self.value
        return abs(x - self.value) <= self.tolerance * abs(self.value)

    def __str__(self) -> str:
        if self.op == "within":
            return f"within {self.tolerance:.0%} of {format_value(self.value, self.unit)}"
        return f"{_OP_TEXT[self.op]} {format_value(self.value, self.unit)}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A target judged on the median of the rounds, with how many single rounds pass it."""

    figure: str
    spread: Spread
    target: Target

    @property
    def passing(self) -> int:
        return sum(self.target.passes(v) for v in self.spread.values)

    @property
    def passed(self) -> bool:
        return self.target.passes(self.spread.median)

    @property
    def unanimous(self) -> bool:
        """Every round agrees with the verdict on the median (none undefined)."""
        return self.passing == self.spread.rounds if self.passed else self.passing == 0

    def line(self) -> str:
        """``figure: 1.42× median (1.21–1.60), 4/5 rounds ≥ 1.3× → PASS``."""
        s, unit = self.spread, self.target.unit
        head = f"{self.figure}: {format_value(s.median, unit)} median"
        if len(s.values) > 1:
            head += f" ({format_value(s.low)}–{format_value(s.high)})"
        undefined = f", {s.missing} undefined" if s.missing else ""
        word = "PASS" if self.passed else "FAIL"
        return f"{head}, {self.passing}/{s.rounds} rounds {self.target}{undefined} → {word}"


# ---- the log of one bench run ------------------------------------------------------------------
@dataclass(slots=True)
class RoundLog:
    """Figures recorded round by round (``record``), ratios taken within each round (``ratio``)."""

    rounds: list[dict[str, float | None]] = field(default_factory=list)
    units: dict[str, str] = field(default_factory=dict)
    wall_s: list[float] = field(default_factory=list)  # each round's wall time (each_round)

    def record(self, round_index: int, name: str, value: float | None, unit: str | None = None) -> None:
        while len(self.rounds) <= round_index:
            self.rounds.append({})
        self.rounds[round_index][name] = value
        if unit is not None:
            self.units[name] = unit

    def ratio(self, name: str, numerator: str, denominator: str) -> None:
        """Record ``numerator / denominator`` in every round (the ratio per round, not of the medians)."""
        for i, figures in enumerate(self.rounds):
            self.record(i, name, ratio(figures.get(numerator), figures.get(denominator)), "×")

    @property
    def names(self) -> list[str]:
        """Every recorded figure, in the order first recorded."""
        seen: dict[str, None] = {}
        for figures in self.rounds:
            seen.update(dict.fromkeys(figures))
        return list(seen)

    def values(self, name: str) -> list[float | None]:
        return [figures.get(name) for figures in self.rounds]

    def spread(self, name: str) -> Spread:
        return spread(self.values(name))

    def verdict(self, name: str, target: Target) -> Verdict:
        return Verdict(name, self.spread(name), target)

    def each_round(self, rounds: int, announce: Any = None) -> Iterator[int]:
        """Round indices 0..rounds-1, each timed into :attr:`wall_s`; ``announce(text)`` is told of each."""
        for r in range(rounds):
            if announce is not None:
                announce(f"round {r + 1} of {rounds}")
            t0 = time.perf_counter()
            yield r
            self.wall_s.append(time.perf_counter() - t0)

    def timing_line(self) -> str:
        if not self.wall_s:
            return ""
        total = sum(self.wall_s)
        return f"{len(self.wall_s)} round(s) in {total:.0f} s ({format_value(total / len(self.wall_s))} s per round)"


def figures_table(log: RoundLog, title: str, targets: Mapping[str, Target] | None = None,
                  names: Sequence[str] | None = None) -> Any:
    """A rich table: each figure's median, min–max, every round's value, and its target if any."""
    from rich.table import Table

    targets = targets or {}
    table = Table(title=title)
    table.add_column("figure")
    columns = ("median", "min–max", *(f"r{i + 1}" for i in range(len(log.rounds))))
    for col in (*columns, "target", "rounds passing") if targets else columns:
        table.add_column(col, justify="right")
    for name in names or log.names:
        s, unit = log.spread(name), log.units.get(name, "")
        target = targets.get(name)
        rng = f"{format_value(s.low)}–{format_value(s.high)}" if len(s.values) > 1 else ""
        cells = [format_value(math.nan if v is None else v) for v in log.values(name)]
        passing = f"{Verdict(name, s, target).passing}/{s.rounds}" if target else ""
        extra = (str(target or ""), passing) if targets else ()
        table.add_row(name, format_value(s.median, unit), rng, *cells, *extra)
    return table


def verdict_markup(verdict: Verdict, prefix: str = "") -> str:
    """The verdict's line in rich markup: green or red, flagged where the rounds disagree."""
    style = "green" if verdict.passed else "red"
    flag = "" if verdict.unanimous else " [yellow](rounds disagree)[/]"
    return f"[{style}]{prefix}{verdict.line()}[/]{flag}"


def verdict_lines(log: RoundLog, targets: Mapping[str, Target]) -> list[str]:
    """One marked-up verdict line per target, then the rounds' timing."""
    lines = [verdict_markup(log.verdict(name, target)) for name, target in targets.items()]
    return [*lines, f"[dim]{log.timing_line()}[/]"] if log.wall_s else lines


def report(console: Any, log: RoundLog, title: str, targets: Mapping[str, Target]) -> list[Verdict]:
    """Print the figures table, one verdict line per target and the rounds' timing; the verdicts."""
    console.print(figures_table(log, title, targets))
    for line in verdict_lines(log, targets):
        console.print(line)
    return [log.verdict(name, target) for name, target in targets.items()]


def make_console() -> Any:
    """The console benches print to: as wide as the terminal, 200 columns into a file or pipe
    (rich's default of 80 would fold every table of a logged run)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


# ---- command line ------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rounds, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--rounds must be at least 1, got {n}")
    return n


def add_rounds_option(parser: argparse.ArgumentParser, default: int | None, why: str = "") -> None:
    """The ``--rounds`` option every bench has; ``why`` says how the default was chosen (``None``:
    the bench's parts each keep their own default, which ``why`` names)."""
    what = f"default {default}{': ' + why if why else ''}" if default is not None else f"default: {why}"
    parser.add_argument("--rounds", type=_positive_int, default=default,
                        help=f"measurement rounds, arms interleaved; the verdict is on the median ({what})")
