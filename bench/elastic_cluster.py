"""Elastic clusters (issue 18), the serving part: the demo cluster loses a node and gains a replacement
while clients stream; the coordinator re-plans as it would in production (``helix serve``'s default
policy: 5 s grace after a death, 5 s planner limit).

    python bench/elastic.py --only cluster [--clients 16] [--max-tokens 64] [--victim cpu-0] [--rounds 4]
    python bench/elastic_cluster.py ...     (the same)

One round:

1. plan ``clusters/demo`` (as ``helix demo`` does), start its three agents and ``helix serve`` (a
   subprocess), and ``--clients`` closed-loop clients streaming ``--max-tokens``-token answers;
2. after a warm-up, the **original** throughput over 20 s; then ``kill -9`` the victim (by default the
   node holding the most layers) and record 40 s; then a replacement (``cpu-3``, GPU ``cpu``, no layer
   cap, as cpu-0) joins with ``helix agent --join`` and 40 s more are recorded;
3. the reference for the death: a **fresh plan of the remaining nodes** (``make_plan`` from scratch),
   served by fresh agents and coordinator under the same load for 20 s.

Throughput is the coordinator's own count of generated tokens (``helix_generated_tokens_total``
from ``/metrics``, sampled every 0.5 s), reported per 5 s window from the death. Targets (the
issue's): the 10 s that end 30 s after the death at ≥ 90 % of the fresh plan's throughput, the 10 s
that end 30 s after the join at ≥ 95 % of the original's (two windows: one 5 s window on this
shared CPU box swings ±15 %); no request lost (every client request answered with [DONE]).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import httpx  # noqa: E402
from harness import RoundLog, Target, add_rounds_option, format_value, make_console, report  # noqa: E402
from rich.table import Table  # noqa: E402

if TYPE_CHECKING:
    from router.launch import AgentProcesses

DEMO = ROOT / "clusters" / "demo" / "cluster.yaml"
PROMPTS = [f"Tell me about {topic} in a few sentences." for topic in
           ("the sea", "mountains", "cats", "rain", "bread", "trains", "the moon", "music")]  # fmt: skip
WINDOW_S = 5.0
DEATH_TARGET, JOIN_TARGET = 0.90, 0.95
# Four rounds: one round's 10 s windows swing ±8 % on a shared 2-core box, and the join figure's steady
# state sits near its target there (two cores, not the nodes, bound the demo cluster): two rounds read
# 0.950x and 0.942x in two runs, four rounds 0.974x (3/4).
CLUSTER_ROUNDS = 4
out = make_console()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan_for(cluster_path: Path, without: str | None, path: Path) -> dict[str, tuple[int, int]]:
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import make_plan
    from planner.replan import without_nodes

    cluster = load_cluster(cluster_path)
    profiles = load_profiles_for(cluster)
    if without:
        cluster = without_nodes(cluster, [without])
    try:
        plan = make_plan(cluster, profiles, method="helix", time_limit_s=20, threads=1)
    except Exception:  # noqa: BLE001 - the method may be unavailable in this build (as helix demo falls back)
        plan = make_plan(cluster, profiles, method="paper-milp", time_limit_s=20, threads=1)
    plan.save(path)
    return dict(plan.placement)


class Cluster:
    """Agents of a plan and ``helix serve`` over them (default re-planning policy; ``flags`` add to
    helix serve's; ``agent_args`` to every ``helix agent``; ``on_agents`` sees the agents once they are ready, before
    the coordinator starts)."""

    def __init__(self, cluster_path: Path, plan_path: Path, workdir: Path, *, flags: Sequence[str] = (),
                 on_agents: Callable[[AgentProcesses], None] | None = None,
                 agent_args: Sequence[str] = ()) -> None:  # fmt: skip
        from router.launch import AgentProcesses

        self.secret = secrets.token_hex(8)
        self.agents = AgentProcesses(cluster_path, plan_path, workdir, secret=self.secret, extra_args=tuple(agent_args))
        self.agents.start(json.loads(plan_path.read_text())["placement"])  # each on a free loopback port
        addresses = self.agents.wait_ready(timeout_s=240)
        if on_agents is not None:
            on_agents(self.agents)
        port = free_port()
        cmd = [sys.executable, "-m", "helix.cli", "serve", "--cluster", str(cluster_path), "--plan", str(plan_path),
               "--port", str(port), "--queue-bound", "4096", *flags,
               *[f"--agent={n}={a}" for n, a in addresses.items()]]  # fmt: skip
        log = open(workdir / "serve.log", "ab")  # noqa: SIM115 - kept open for the subprocess's life
        self.serve = subprocess.Popen(cmd, env={**os.environ, "HELIX_SECRET": self.secret}, stdout=log, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("helix serve did not become ready")

    def tokens(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(r"^helix_generated_tokens_total ([0-9.e+]+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def view(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/v1/cluster", timeout=10).json())

    def close(self) -> None:
        self.serve.send_signal(signal.SIGTERM)
        try:
            self.serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.serve.kill()
        self.agents.stop()


class LostRequest(Exception):
    """A request that did not end with ``data: [DONE]`` (an HTTP error, an error chunk)."""


def stream_answer(http: httpx.Client, prompt: str, max_tokens: int) -> str:
    """One streamed greedy chat answer to ``prompt``: its text; LostRequest when it did not finish."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    if resp.status_code != 200 or lines[-1:] != ["data: [DONE]"] or \
            any(line.startswith('data: {"error"') for line in lines):
        raise LostRequest(f"HTTP {resp.status_code}: {' '.join(lines)[-200:]}")
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1] if line.startswith("data: ")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


class Load:
    """``n`` threads streaming answers in a loop (each answer's prompt and text kept in ``texts``); a sampler
    of the coordinator's token count."""

    def __init__(self, cluster: Cluster, n: int, max_tokens: int) -> None:
        self.cluster, self.max_tokens, self.stop = cluster, max_tokens, threading.Event()
        self.answered, self.errors = 0, []  # type: ignore[var-annotated]
        self.texts: list[tuple[str, str]] = []  # (prompt, answer), in the order they finished
        self.samples: list[tuple[float, float]] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]
        self.threads.append(threading.Thread(target=self._sample, daemon=True))
        for thread in self.threads:
            thread.start()

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.cluster.url, timeout=600) as http:
            while not self.stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                i += 1
                try:
                    text = stream_answer(http, prompt, self.max_tokens)
                    self.texts.append((prompt, text))
                    self.answered += 1
                except LostRequest as exc:
                    self.errors.append(str(exc))
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def _sample(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.cluster.tokens()))
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def rate(self, t0: float, t1: float) -> float:
        """Tokens/s between ``t0`` and ``t1`` (monotonic), from the samples nearest inside."""
        inside = [(t, n) for t, n in self.samples if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)


def one_round(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cluster_path = DEMO
    placement = plan_for(cluster_path, None, workdir / "plan.json")
    victim = args.victim or max(placement, key=lambda n: placement[n][1] - placement[n][0])
    out.print(f"[dim]demo plan {placement}; victim {victim}[/]")
    served = Cluster(cluster_path, workdir / "plan.json", workdir)
    events: list[tuple[float, str]] = []
    try:
        load = Load(served, args.clients, args.max_tokens)
        time.sleep(15)  # warm-up
        t = time.monotonic()
        time.sleep(20)
        original = load.rate(t, time.monotonic())
        death = time.monotonic()
        served.agents.kill(victim)
        events.append((0.0, f"{victim} killed"))
        time.sleep(40)
        join = time.monotonic()
        served.agents.start_joining("cpu-3", served.url, "cpu")
        events.append((join - death, "cpu-3 starts, joins"))
        time.sleep(40)
        load.close()
        end = time.monotonic()
        view = served.view()
        for item in view["history"]:
            events.append((time.monotonic() - item["ago_s"] - death, item["what"]))
        answered, errors = load.answered, list(load.errors)
    finally:
        served.close()
    fresh_plan = plan_for(cluster_path, victim, workdir / "fresh.json")
    out.print(f"[dim]fresh plan of the remaining nodes: {fresh_plan}[/]")
    (workdir / "fresh").mkdir()
    fresh = Cluster(cluster_path, workdir / "fresh.json", workdir / "fresh")
    try:
        ref_load = Load(fresh, args.clients, args.max_tokens)
        time.sleep(15)
        t = time.monotonic()
        time.sleep(20)
        fresh_rate = ref_load.rate(t, time.monotonic())
        ref_load.close()
    finally:
        fresh.close()
    timeline = [(k * WINDOW_S, load.rate(death + k * WINDOW_S, death + (k + 1) * WINDOW_S))
                for k in range(int((end - death) // WINDOW_S))]
    return {"original": original, "fresh": fresh_rate, "death": death, "join": join, "timeline": timeline,
            "events": sorted(events), "answered": answered, "errors": errors, "victim": victim,
            "after_death": load.rate(death + 20, death + 30), "after_join": load.rate(join + 20, join + 30),
            "final": view["plan"]["placement"]}  # fmt: skip


def timeline_table(r: dict[str, Any]) -> Table:
    table = Table(title=f"tok/s per {WINDOW_S:g} s from the death of {r['victim']} (original {r['original']:.0f}, "
                        f"fresh plan of the rest {r['fresh']:.0f})")  # fmt: skip
    for col in ("from death, s", "tok/s", "÷ fresh", "÷ original", "events in the window"):
        table.add_column(col, justify="left" if col.startswith("events") else "right")
    for start, rate in r["timeline"]:
        what = "; ".join(e for t, e in r["events"] if start <= t < start + WINDOW_S)
        table.add_row(f"{start:.0f}-{start + WINDOW_S:.0f}", format_value(rate), format_value(rate / r["fresh"], "×"),
                      format_value(rate / r["original"], "×"), what)  # fmt: skip
    return table


def bench_cluster(args: argparse.Namespace) -> None:
    log = RoundLog()
    for r in log.each_round(args.rounds, announce=lambda text: out.print(f"[dim]cluster: {text}[/]")):
        workdir = Path(tempfile.mkdtemp(prefix="helix-elastic-"))
        result = one_round(args, workdir)
        out.print(timeline_table(result))
        out.print(f"round {r + 1}: {result['answered']} requests answered, {len(result['errors'])} lost; final "
                  f"placement {result['final']}")  # fmt: skip
        for error in result["errors"][:3]:
            out.print(f"[red]  lost: {error}[/]")
        log.record(r, "20-30 s after the death ÷ fresh plan of the rest", result["after_death"] / result["fresh"], "×")
        log.record(r, "20-30 s after the join ÷ original", result["after_join"] / result["original"], "×")
        log.record(r, "lost requests", len(result["errors"]), "")
        shutil.rmtree(workdir, ignore_errors=True)
    report(out, log, f"demo cluster, {args.clients} streaming clients, {args.rounds} round(s)", {
        "20-30 s after the death ÷ fresh plan of the rest": Target(">=", DEATH_TARGET),
        "20-30 s after the join ÷ original": Target(">=", JOIN_TARGET),
        "lost requests": Target("<=", 0),
    })


def add_cluster_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", type=int, default=16, help="closed-loop streaming clients (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--victim", help="the node killed (default: the one holding the most layers)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(ap)
    add_rounds_option(ap, CLUSTER_ROUNDS, "a round takes about 3-4 minutes (two clusters started); one round's "
                                          "10 s windows swing ±8 per cent")
    bench_cluster(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
