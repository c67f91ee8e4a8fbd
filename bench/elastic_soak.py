"""Elastic clusters (issue 18), the soak: the demo cluster serving 16 streaming clients through random
membership events for 5 minutes, ``helix serve`` re-planning with its default policy.

    python bench/elastic.py --only soak [--duration-s 300] [--events 20] [--seed 0] [--clients 16]
                            [--max-tokens 64] [--max-agents 4] [--warmup-s 20]
    python bench/elastic_soak.py ...     (the same)
    python bench/elastic_soak.py --duration-s 60 --events 4     (a smoke run: its verdicts mean nothing)

One run (the demo cluster, its agents, ``helix serve`` and the clients are
``bench/elastic_cluster.py``'s):

1. plan ``clusters/demo`` and start its three agents and ``helix serve``; ask every prompt once,
   alone, for its **reference** (the greedy answer of the undisturbed cluster, as
   ``tests/router/test_live_membership.py`` does);
2. ``--clients`` closed-loop clients stream ``--max-tokens``-token answers for the whole run; after
   ``--warmup-s`` the coordinator's RSS (psutil, every 2 s) has its baseline;
3. ``--events`` events over ``--duration-s`` seconds, drawn with ``--seed``: one per equal slot at a
   random point of its middle 60 %, each a ``kill -9`` (40 %), a leave (``SIGTERM``: the agent drains,
   20 %) or a join (a fresh agent ``join-N``, GPU ``cpu``, started with ``helix agent --join``, 40 %).
   The model stays coverable: a node is removed only if the routed plan does not serve through it
   (joining, standby) or its other serving nodes still hold every layer without it, and at most ``--max-agents`` agents run at once; a removal that
   cannot be made becomes a join and a join that cannot be made a removal (an event that can be
   neither waits, up to the next event's time, then is skipped);
4. after the last event the cluster settles (the reconfiguration in progress done, every placed node
   serving; at most 90 s) under the same load; then the clients stop.

Figures: events applied (by kind), requests answered, **lost** (not ended with ``[DONE]``: an HTTP
error, an error chunk, a broken stream), **wrong** (an answer not equal to its prompt's reference),
the coordinator's RSS after the warm-up, at the end, its maximum, and the slope of a least-squares
line through its samples of the run's second half (events and settling). Targets: 0 lost, 0 wrong,
RSS growth (end - after warm-up) ≤ :data:`RSS_GROWTH_MIB` MiB, slope ≤ :data:`RSS_SLOPE_MIB_PER_MIN`
MiB/min (bench/README.md says why these bounds). The re-planner's worker process (the coordinator's
child) is reported beside it, not counted in it.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from elastic_cluster import DEMO, PROMPTS, Cluster, Load, plan_for, stream_answer  # noqa: E402
from harness import RoundLog, Target, format_value, make_console, report  # noqa: E402
from rich.table import Table  # noqa: E402

KINDS, WEIGHTS = ("kill", "leave", "join"), (0.4, 0.2, 0.4)
RSS_EVERY_S = 2.0
STATUS_EVERY_S = 15.0
SETTLE_S = 90.0
RSS_GROWTH_MIB = 16.0
RSS_SLOPE_MIB_PER_MIN = 2.0
out = make_console()


def draw_events(n: int, duration_s: float, seed: int) -> list[tuple[float, str]]:
    """``n`` (seconds from the start, kind) drawn with ``seed``: one per equal slot, in its middle 60 %."""
    rng = random.Random(seed)
    slot = duration_s / n
    return [(slot * (k + rng.uniform(0.2, 0.8)), rng.choices(KINDS, WEIGHTS)[0]) for k in range(n)]


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """The least-squares slope of (monotonic s, MiB) samples, MiB per minute (nan under 3 samples)."""
    if len(samples) < 3:
        return float("nan")
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    t0, y0 = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - t0) ** 2 for t in ts)
    return 60.0 * sum((t - t0) * (y - y0) for t, y in zip(ts, ys, strict=True)) / den if den else float("nan")


class RssSampler:
    """The RSS of process ``pid`` (and of its children together: the re-planner's worker), MiB, every 2 s."""

    def __init__(self, pid: int) -> None:
        self.process, self.stop = psutil.Process(pid), threading.Event()
        self.samples: list[tuple[float, float]] = []
        self.children: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(RSS_EVERY_S):
            try:
                now, rss = time.monotonic(), self.process.memory_info().rss / 2**20
                kids = sum(c.memory_info().rss for c in self.process.children(recursive=True)) / 2**20
            except psutil.Error:
                continue
            self.samples.append((now, rss))
            self.children.append((now, kids))

    def around(self, t: float, which: str = "samples") -> float:
        """The mean of the 3 samples nearest before ``t`` (monotonic)."""
        before = [y for s, y in getattr(self, which) if s <= t][-3:]
        return statistics.fmean(before) if before else float("nan")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class Events:
    """Applies the drawn events to the served cluster, keeping the model coverable (see the module doc)."""

    def __init__(self, served: Cluster, num_layers: int, max_agents: int, seed: int) -> None:
        self.served, self.num_layers, self.max_agents = served, num_layers, max_agents
        self.rng = random.Random(seed + 1)
        self.running = set(served.agents.agents)  # agents started and not removed by us
        self.joins = 0
        self.applied: list[tuple[float, str, str]] = []  # (time, kind, node)

    def removable(self) -> list[str]:
        """Our members the routed plan can do without: those it does not serve through (joining, standby), and
        serving nodes whose loss leaves every layer held by another serving node."""
        view = self.served.view()
        placement = {n: tuple(r) for n, r in view["plan"]["placement"].items()}
        states = {m["node"]: m["state"] for m in view["members"] if m["node"] in self.running}
        serving = {n for n, state in states.items() if state == "serving"}
        idle = [n for n, state in states.items() if state in ("joining", "standby")]
        return sorted(idle) + [n for n in sorted(serving) if all(
            any(placement[o][0] <= layer < placement[o][1] for o in serving - {n}) for layer in range(self.num_layers))]

    def apply(self, kind: str) -> tuple[str, str] | None:
        """Apply ``kind`` or its substitute now; (kind, node), or None when neither can be made."""
        try:
            removable = self.removable()
        except httpx.HTTPError:
            return None
        can_join = len(self.running) < self.max_agents
        if kind != "join" and not removable:
            kind = "join"
        if kind == "join" and not can_join:
            kind = "kill" if removable else ""
        if not kind:
            return None
        if kind == "join":
            self.joins += 1
            node = f"join-{self.joins}"
            self.served.agents.start_joining(node, self.served.url, "cpu")
            self.running.add(node)
        else:
            node = self.rng.choice(removable)
            self.running.discard(node)
            if kind == "kill":
                self.served.agents.kill(node)  # kill -9, reaped
            else:
                self.served.agents.agents[node].popen.send_signal(signal.SIGTERM)  # it drains, then exits
        self.applied.append((time.monotonic(), kind, node))
        return kind, node


def settled(view: dict[str, Any]) -> bool:
    placement = view["plan"]["placement"]
    return view["reconfiguration"] is None and all(m["state"] == "serving" for m in view["members"]
                                                   if m["node"] in placement)  # fmt: skip


def status(served: Cluster, load: Load, wrong: int, rss: RssSampler, t0: float) -> str:
    try:
        view = served.view()
        plan = f"plan v{view['version']} {view['plan']['placement']}"
        phase = (view["reconfiguration"] or {}).get("phase")
    except httpx.HTTPError as exc:
        plan, phase = f"(no view: {type(exc).__name__})", None
    now_rss = rss.samples[-1][1] if rss.samples else float("nan")
    return (f"{time.monotonic() - t0:+6.0f} s  {load.answered} answered, {len(load.errors)} lost, {wrong} wrong; "
            f"{plan}{f' ({phase})' if phase else ''}; coordinator RSS {now_rss:.0f} MiB")  # fmt: skip


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    placement = plan_for(DEMO, None, workdir / "plan.json")
    num_layers = max(end for _, end in placement.values())
    schedule = draw_events(args.events, args.duration_s, args.seed)
    out.print(f"[dim]demo plan {placement}; {args.events} events over {args.duration_s:g} s (seed {args.seed}): "
              f"{', '.join(f'{t:.0f} s {k}' for t, k in schedule)}[/]")  # fmt: skip
    served = Cluster(DEMO, workdir / "plan.json", workdir)
    try:
        with httpx.Client(base_url=served.url, timeout=600) as http:
            references = {p: stream_answer(http, p, args.max_tokens) for p in PROMPTS}
        out.print(f"[dim]references: {len(references)} prompts answered alone[/]")
        rss = RssSampler(served.serve.pid)
        load = Load(served, args.clients, args.max_tokens)
        t0 = time.monotonic() + args.warmup_s  # the events' start: times printed are from it
        events = Events(served, num_layers, args.max_agents, args.seed)
        checked, last_status = 0, t0
        wrong: list[tuple[str, str]] = []

        def check() -> None:
            nonlocal checked, last_status
            texts = load.texts[checked:]
            checked += len(texts)
            wrong.extend((p, t) for p, t in texts if t != references[p])
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                last_status = time.monotonic()
                out.print(status(served, load, len(wrong), rss, t0))

        while time.monotonic() < t0:
            check()
            time.sleep(0.2)
        start = time.monotonic()
        out.print(f"warm-up done: coordinator RSS {rss.around(start):.0f} MiB; events start")
        skipped = 0
        for k, (at, kind) in enumerate(schedule):
            due = start + at
            until = start + schedule[k + 1][0] if k + 1 < len(schedule) else start + args.duration_s
            while time.monotonic() < due:
                check()
                time.sleep(0.2)
            done = None
            while done is None and time.monotonic() < until:
                done = events.apply(kind)
                if done is None:
                    check()
                    time.sleep(1.0)
            if done is None:
                skipped += 1
                out.print(f"{time.monotonic() - t0:+6.0f} s  event {k + 1} ({kind}) skipped: no node can go, no "
                          f"agent can start")  # fmt: skip
            else:
                out.print(f"{time.monotonic() - t0:+6.0f} s  event {k + 1}/{len(schedule)}: {done[0]} {done[1]}"
                          f"{'' if done[0] == kind else f' (drawn: {kind})'}")  # fmt: skip
        while time.monotonic() < start + args.duration_s:
            check()
            time.sleep(0.2)
        events_end = time.monotonic()
        while time.monotonic() < events_end + SETTLE_S:
            check()
            try:
                if settled(served.view()):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        end = time.monotonic()
        out.print(f"settled {end - events_end:.0f} s after the events; stopping the clients")
        final = served.view()
        load.close()
        check()
        rss.close()
    finally:
        served.close()
    second_half = [(t, y) for t, y in rss.samples if start + (end - start) / 2 <= t <= end]
    return {"applied": events.applied, "skipped": skipped, "answered": load.answered, "errors": list(load.errors),
            "wrong": wrong, "references": references, "final": final, "rss_start": rss.around(start),
            "rss_end": rss.around(end), "rss_max": max((y for t, y in rss.samples if t <= end), default=float("nan")),
            "slope": slope_per_min(second_half), "worker_start": rss.around(start, "children"),
            "worker_end": rss.around(end, "children"), "seconds": end - start}  # fmt: skip


def figures(r: dict[str, Any]) -> Table:
    table = Table(title=f"soak: {r['seconds']:.0f} s of events and settling")
    table.add_column("figure")
    table.add_column("value", justify="right")
    kinds = {k: sum(kind == k for _, kind, _ in r["applied"]) for k in KINDS}
    rows = [
        ("events applied", f"{len(r['applied'])} ({kinds['kill']} kill -9, {kinds['leave']} leave, {kinds['join']} "
                           f"join; {r['skipped']} skipped)"),
        ("requests answered", str(r["answered"])),
        ("lost", str(len(r["errors"]))),
        ("wrong", str(len(r["wrong"]))),
        ("coordinator RSS after warm-up / end / max", f"{r['rss_start']:.1f} / {r['rss_end']:.1f} / {r['rss_max']:.1f} MiB"),
        ("coordinator RSS growth (end - after warm-up)", f"{r['rss_end'] - r['rss_start']:+.1f} MiB"),
        ("coordinator RSS slope, second half", f"{r['slope']:+.2f} MiB/min"),
        ("re-planner worker RSS after warm-up / end", f"{r['worker_start']:.1f} / {r['worker_end']:.1f} MiB"),
        ("final plan", str(r["final"]["plan"]["placement"])),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    return table


def bench_soak(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="helix-soak-"))
    r = run(args, workdir)
    out.print(figures(r))
    for error in r["errors"][:3]:
        out.print(f"[red]  lost: {error}[/]")
    for prompt, text in r["wrong"][:3]:
        out.print(f"[red]  wrong: {prompt!r}: {text!r}, expected {r['references'][prompt]!r}[/]")
    log = RoundLog()
    log.record(0, "lost requests", len(r["errors"]), "")
    log.record(0, "wrong answers", len(r["wrong"]), "")
    log.record(0, "coordinator RSS growth after warm-up", r["rss_end"] - r["rss_start"], "MiB")
    log.record(0, "coordinator RSS slope, second half", r["slope"], "MiB/min")
    verdicts = report(out, log, f"soak: {len(r['applied'])} events, {args.clients} streaming clients", {
        "lost requests": Target("<=", 0, unit=""),
        "wrong answers": Target("<=", 0, unit=""),
        "coordinator RSS growth after warm-up": Target("<=", RSS_GROWTH_MIB, unit="MiB"),
        "coordinator RSS slope, second half": Target("<=", RSS_SLOPE_MIB_PER_MIN, unit="MiB/min"),
    })
    if all(v.passed for v in verdicts):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        out.print(f"[dim]logs kept in {workdir}[/]")
    out.print(f"[dim]bounds: RSS growth ≤ {format_value(RSS_GROWTH_MIB, 'MiB')}, slope ≤ "
              f"{format_value(RSS_SLOPE_MIB_PER_MIN, 'MiB/min')} (bench/README.md)[/]")  # fmt: skip


def add_soak_arguments(ap: argparse.ArgumentParser) -> None:
    """The soak's own options (``--clients`` and ``--max-tokens`` are the cluster bench's)."""
    ap.add_argument("--duration-s", type=float, default=300.0, help="seconds of events (default 300)")
    ap.add_argument("--events", type=int, default=20, help="membership events (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="draws the events' times, kinds and victims (default 0)")
    ap.add_argument("--max-agents", type=int, default=4, help="agents running at once, at most (default 4)")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="load before the RSS baseline (default 20)")


def main() -> int:
    from elastic_cluster import add_cluster_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(ap)
    add_soak_arguments(ap)
    bench_soak(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
