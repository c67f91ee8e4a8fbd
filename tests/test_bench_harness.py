"""bench/harness.py's pure parts with fabricated numbers: order, spread, ratio, target, verdict.

No bench runs here (they take minutes and their numbers depend on the machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "harness.py"
_spec = importlib.util.spec_from_file_location("bench_harness", PATH)
assert _spec is not None and _spec.loader is not None
h = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = h  # dataclasses look their module up while the file runs
_spec.loader.exec_module(h)


def test_two_arms_run_abba() -> None:
    assert [arm for _, arm in h.interleaved(["A", "B"], 4)] == list("ABBAABBA")
    assert [r for r, _ in h.interleaved(["A", "B"], 2)] == [0, 0, 1, 1]


def test_more_arms_alternate_direction() -> None:
    assert h.arm_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert h.arm_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert h.arm_order(("x",), 5) == ["x"]


def test_a_linear_drift_costs_both_arms_the_same_over_abba() -> None:
    # slot k of the run is slowed by k: over an even number of ABBA rounds both arms lose alike
    slowed: dict[str, int] = {"A": 0, "B": 0}
    for k, (_, arm) in enumerate(h.interleaved(["A", "B"], 4)):
        slowed[arm] += k
    assert slowed["A"] == slowed["B"]


def test_spread_median_and_range() -> None:
    s = h.spread([1.6, 1.21, 1.42, 1.3, 1.5])
    assert (s.median, s.low, s.high, s.rounds, s.missing) == (1.42, 1.21, 1.6, 5, 0)
    assert s.describe("×") == "1.42× (1.21–1.60)"
    assert h.spread([2.0, 4.0]).median == 3.0


def test_spread_counts_undefined_rounds() -> None:
    s = h.spread([1.0, None, math.nan, 3.0])
    assert s.values == (1.0, 3.0) and s.missing == 2 and s.rounds == 4 and s.median == 2.0
    empty = h.spread([None])
    assert math.isnan(empty.median) and empty.describe() == "—"


def test_ratio_is_per_round_then_median() -> None:
    log = h.RoundLog()
    # ours / theirs per round: 2/1 = 2, 3/3 = 1, 8/2 = 4 -> median 2; the ratio of medians would be 3/2
    for r, (ours, theirs) in enumerate([(2.0, 1.0), (3.0, 3.0), (8.0, 2.0)]):
        log.record(r, "ours", ours)
        log.record(r, "theirs", theirs)
    log.ratio("ours / theirs", "ours", "theirs")
    assert log.values("ours / theirs") == [2.0, 1.0, 4.0]
    assert log.spread("ours / theirs").median == 2.0
    assert log.units["ours / theirs"] == "×"


def test_ratio_undefined_sides() -> None:
    assert h.ratio(1.0, 0.0) is None
    assert h.ratio(None, 2.0) is None
    assert h.ratio(1.0, math.nan) is None
    assert h.ratio(3.0, 2.0) == 1.5


def test_targets() -> None:
    at_least = h.Target(">=", 2.0)
    assert at_least.passes(2.0) and not at_least.passes(1.99) and not at_least.passes(None)
    at_most = h.Target("<=", 50.0, unit="µs")
    assert at_most.passes(50.0) and not at_most.passes(50.1) and not at_most.passes(math.nan)
    within = h.Target("within", 1.0, unit="", tolerance=0.15)
    assert within.passes(0.86) and within.passes(1.15) and not within.passes(1.16) and not within.passes(0.84)
    assert str(at_least) == "≥ 2.00×" and str(at_most) == "≤ 50.0 µs" and str(within) == "within 15% of 1.00"


def test_verdict_line_on_the_median_with_rounds_passing() -> None:
    v = h.Verdict("throughput ratio", h.spread([1.21, 1.42, 1.60, 1.35, 1.25]), h.Target(">=", 1.3))
    assert v.passed and v.passing == 3 and not v.unanimous
    assert v.line() == "throughput ratio: 1.35× median (1.21–1.60), 3/5 rounds ≥ 1.30× → PASS"


def test_verdict_fails_on_the_median_even_if_one_round_passes() -> None:
    v = h.Verdict("r", h.spread([1.9, 2.3, 1.7, None]), h.Target(">=", 2.0))
    assert not v.passed and v.passing == 1
    assert v.line() == "r: 1.90× median (1.70–2.30), 1/4 rounds ≥ 2.00×, 1 undefined → FAIL"


def test_unanimous_verdicts() -> None:
    assert h.Verdict("r", h.spread([2.1, 2.5]), h.Target(">=", 2.0)).unanimous
    assert h.Verdict("r", h.spread([1.1, 1.5]), h.Target(">=", 2.0)).unanimous
    assert not h.Verdict("r", h.spread([2.1, None, 2.2]), h.Target(">=", 2.0)).unanimous


def test_format_value() -> None:
    assert h.format_value(1934.2, "tok/s") == "1934 tok/s"
    assert h.format_value(12.34, "µs") == "12.3 µs"
    assert h.format_value(0.1384) == "0.138"
    assert h.format_value(7.4, "%") == "7.40%"


def test_round_log_keeps_figure_order_and_timing() -> None:
    log = h.RoundLog()
    announced: list[str] = []
    for r in log.each_round(2, announced.append):
        log.record(r, "b", 1.0)
        log.record(r, "a", 2.0)
    assert log.names == ["b", "a"] and len(log.wall_s) == 2
    assert announced == ["round 1 of 2", "round 2 of 2"]
    assert log.timing_line().startswith("2 round(s) in ")


def test_figures_table_has_a_column_per_round() -> None:
    from rich.console import Console

    log = h.RoundLog()
    for r, x in enumerate([2.2, 1.8, 2.4]):
        log.record(r, "ratio", x, "×")
    table = h.figures_table(log, "t", {"ratio": h.Target(">=", 2.0)})
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "2.20×" in text and "1.80–2.40" in text and "2/3" in text and "r3" in text


def test_rounds_option() -> None:
    parser = argparse.ArgumentParser()
    h.add_rounds_option(parser, 5, "stable")
    assert parser.parse_args([]).rounds == 5
    assert parser.parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
