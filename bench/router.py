"""Routing benchmark (issue 4, "Numbers to reach"): decision time and flow-proportional shares.

Measures on the paper's 24-node cluster with the paper's MILP placement (flows computed by
``planner.graph``):

1. routing decision time (pipeline construction with KV masking, plus the reservation) per
   request, median and p99, with ~200 requests in flight so masking is exercised;
2. over 10,000 routed requests, each edge's share of requests vs its share of the plan's flow
   (requests over the edge / requests routed  vs  edge flow / max flow).

Both in rounds (``bench/harness.py``, default 5, a few seconds each): the verdicts are on the
medians over the rounds (decision time is a timing on shared cores; the shares are deterministic,
so their rounds agree by construction). End-to-end serving numbers (concurrent streaming
requests, tokens/s ceiling, TTFT on the demo cluster) are measured by ``bench/serving.py``.

Run: ``.venv/bin/python bench/router.py [--rounds 5]``
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.table import Table  # noqa: E402

from helix.plan import load_plan  # noqa: E402
from helix.profile import load_profiles_for  # noqa: E402
from helix.spec import load_cluster  # noqa: E402
from router.policy import Router, RouteRequest  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))  # after the packages: bench/router.py must not shadow router/
from harness import RoundLog, Target, add_rounds_option, make_console, report  # noqa: E402

CLUSTER = ROOT / "clusters" / "helix-paper-single24" / "cluster.yaml"
PLAN = ROOT / "clusters" / "helix-paper-single24" / "reference" / "milp.json"


def make_router() -> Router:
    cluster = load_cluster(CLUSTER)
    return Router.from_plan(load_plan(PLAN), cluster, load_profiles_for(cluster))


def decision_time(n: int = 20_000, in_flight: int = 200) -> tuple[float, float]:
    router = make_router()
    times: list[float] = []
    gc.disable()
    try:
        for i in range(n):
            t0 = time.perf_counter()
            router.route(RouteRequest(i, 763))
            times.append(time.perf_counter() - t0)
            if i >= in_flight:
                router.finish(i - in_flight)
    finally:
        gc.enable()
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.99 * len(times))] * 1e6


def edge_shares(n: int = 10_000) -> list[tuple[str, str, float, float]]:
    router = make_router()
    counts: Counter[tuple[str, str]] = Counter()
    coord = router.topology.coordinator
    for i in range(n):
        p = router.route(RouteRequest(i, 763))
        router.finish(i)
        hops = [coord, *p.nodes, coord]
        counts.update(zip(hops, hops[1:], strict=False))
    flows: dict[tuple[str, str], float] = {}
    for v, w in router.iwrr.items():
        for c, f in w.weights.items():
            if f > 0:
                flows[(v, c)] = f
    total = sum(f for (s, _), f in flows.items() if s == coord)
    return [(s, d, f / total, counts[(s, d)] / n) for (s, d), f in sorted(flows.items())]


MEDIAN = "median decision µs / request"
SHARE = "worst relative edge-share diff (edges ≥ 1% of flow)"
TARGETS = {MEDIAN: Target("<=", 50.0, unit="µs"), SHARE: Target("<=", 2.0, unit="%")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rounds_option(ap, 5, "a few seconds each")
    args = ap.parse_args()
    console = make_console()
    log = RoundLog()
    rows: list[tuple[str, str, float, float]] = []
    for r in log.each_round(args.rounds):
        median_us, p99_us = decision_time()
        rows = edge_shares()
        log.record(r, MEDIAN, median_us, "µs")
        log.record(r, "p99 decision µs / request", p99_us, "µs")
        log.record(r, "worst |diff| of edge share, points", 100 * max(abs(x[3] - x[2]) for x in rows))
        log.record(r, SHARE, 100 * max(abs(x[3] - x[2]) / x[2] for x in rows if x[2] >= 0.01), "%")
    t = Table(title="Edge share of 10,000 routed requests vs share of the plan's flow (the last round)")
    for col in ("edge", "flow share", "request share", "diff (points)"):
        t.add_column(col, justify="right" if col != "edge" else "left")
    for s, d, fs, rs in rows:
        t.add_row(f"{s} -> {d}", f"{fs:.4f}", f"{rs:.4f}", f"{100 * (rs - fs):+.2f}")
    console.print(t)
    verdicts = report(console, log, f"Routing on the 24-node paper cluster, MILP plan, KV masking on ({len(rows)} edges), "
                                    f"{args.rounds} round(s)", TARGETS)
    console.print("[dim]end-to-end serving numbers: bench/serving.py[/]")
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
