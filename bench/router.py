"""Routing benchmark (issue 4, "Numbers to reach"): decision time and flow-proportional shares.

Measures on the paper's 24-node cluster with the paper's MILP placement (flows computed by
``planner.graph``):

1. routing decision time (pipeline construction with KV masking, plus the reservation) per
   request, median and p99, with ~200 requests in flight so masking is exercised;
2. over 10,000 routed requests, each edge's share of requests vs its share of the plan's flow
   (requests over the edge / requests routed  vs  edge flow / max flow).

End-to-end serving numbers (concurrent streaming requests, tokens/s ceiling, TTFT on the demo
cluster) are measured by ``bench/serving.py``.

Run: ``.venv/bin/python bench/router.py``
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from helix.plan import load_plan  # noqa: E402
from helix.profile import load_profiles_for  # noqa: E402
from helix.spec import load_cluster  # noqa: E402
from router.policy import Router, RouteRequest  # noqa: E402

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


def main() -> int:
    console = Console()
    median_us, p99_us = decision_time()
    t = Table(title="Routing decision (24-node paper cluster, MILP plan, KV masking on)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_row("median µs / request", f"{median_us:.1f}", "≤ 50")
    t.add_row("p99 µs / request", f"{p99_us:.1f}", "")
    console.print(t)

    rows = edge_shares()
    worst_abs = max(abs(r[3] - r[2]) for r in rows)
    worst_rel = max(abs(r[3] - r[2]) / r[2] for r in rows if r[2] >= 0.01)
    t = Table(title="Edge share of 10,000 routed requests vs share of the plan's flow")
    for col in ("edge", "flow share", "request share", "diff (points)"):
        t.add_column(col, justify="right" if col != "edge" else "left")
    for s, d, fs, rs in rows:
        t.add_row(f"{s} -> {d}", f"{fs:.4f}", f"{rs:.4f}", f"{100 * (rs - fs):+.2f}")
    console.print(t)
    console.print(
        f"edges: {len(rows)}  worst |diff| = {100 * worst_abs:.3f} points, worst relative diff "
        f"(edges with ≥1% of flow) = {100 * worst_rel:.2f}%  (target: within 2%)"
    )
    console.print("[dim]end-to-end serving numbers: bench/serving.py[/]")
    ok = median_us <= 50 and worst_rel <= 0.02
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
