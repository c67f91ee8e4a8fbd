"""CURVE on vs off: the demo cluster's throughput with every socket encrypted and authenticated.

The demo cluster (3 SmolLM2-135M agents on loopback, one torch thread each, planned by the planner,
``helix serve`` in front) is started twice from the same plan: once from a copy of
``clusters/demo/cluster.yaml`` as it is (no keys: the loopback default), once from a copy with
``keys_dir`` naming key pairs ``helix keys`` wrote (ZeroMQ CURVE on every control and data socket,
ZAP checking every peer's key). Both clusters stay up; each round runs the same chat load on each
(``--clients`` concurrent streaming clients, ``--requests`` requests of ``--max-tokens`` tokens), in
ABBA order (bench/harness.py). Figures per arm: decode tokens/s, and CPU seconds per 1000 tokens of
all four processes (agents + coordinator: where CURVE's encryption shows even when the 2 cores are
not the bottleneck). The verdict: CURVE-on ÷ CURVE-off tokens/s, per round, median >= 0.95x.
``--aa`` starts the "on" cluster without keys too (an A/A run: what the set-up alone does to the
ratio, e.g. which cluster started first).

    python bench/curve.py [--rounds 5] [--clients 8] [--requests 24] [--max-tokens 32] [--aa]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))  # after the packages: bench/router.py must not shadow router/
from harness import RoundLog, Target, add_rounds_option, arm_order, make_console, report  # noqa: E402
from serving import DEMO_CLUSTER, plan_demo, run_load, start_serve  # noqa: E402

ARMS = ("off", "on")
TARGET = Target(">=", 0.95)
VERDICT = "CURVE on ÷ off, tok/s"


def write_clusters(workdir: Path, aa: bool = False) -> dict[str, Path]:
    """The demo cluster file twice (profiles by absolute path): as it is, and with ``keys_dir: keys``
    (``aa``: without, the A/A control)."""
    from helix.cli import main as helix

    raw = yaml.safe_load(DEMO_CLUSTER.read_text())
    raw["profiles"] = str((DEMO_CLUSTER.parent / raw["profiles"]).resolve())
    paths = {"off": workdir / "cluster-off.yaml", "on": workdir / "cluster-on.yaml"}
    paths["off"].write_text(yaml.safe_dump(raw, sort_keys=False))
    paths["on"].write_text(yaml.safe_dump(raw if aa else {**raw, "keys_dir": "keys"}, sort_keys=False))
    if helix(["keys", str(workdir / "keys"), "--cluster", str(paths["on"])]) != 0:
        raise SystemExit("helix keys failed")
    return paths


@contextmanager
def demo_cluster(cluster: Path, plan: Path, workdir: Path, secret: str) -> Iterator[tuple[str, list[int]]]:
    """Three agents and ``helix serve`` for ``cluster``: (base URL, every process id)."""
    from helix.plan import load_plan
    from router.launch import AgentProcesses

    workdir.mkdir()
    with AgentProcesses(cluster, plan, workdir, secret=secret) as agents:
        agents.start(load_plan(plan).placement)
        addresses = agents.wait_ready(timeout_s=300)
        serve, base = start_serve(cluster, plan, addresses, secret)
        try:
            yield base, [*agents.pids(), serve.pid]
        finally:
            serve.terminate()
            serve.wait(timeout=20)


def cpu_seconds(pids: list[int]) -> float:
    from helix.processes import cpu_seconds as process_cpu_seconds

    return sum(process_cpu_seconds(pid) for pid in pids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rounds_option(p, 5, "≈ 40 s per round here")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming chat clients")
    p.add_argument("--requests", type=int, default=24, help="requests per arm per round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--aa", action="store_true", help="no keys in either cluster: the set-up's own bias (A/A)")
    p.add_argument("--quick", action="store_true", help="one round of 8 requests (a smoke run: its verdict means nothing)")
    args = p.parse_args()
    rounds, requests = (1, 8) if args.quick else (args.rounds, args.requests)
    console = make_console()
    console.print(f"CURVE bench on {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f})")
    workdir = Path(tempfile.mkdtemp(prefix="helix-bench-curve-"))
    secret = secrets.token_hex(8)
    log = RoundLog()
    try:
        plan = plan_demo(workdir)
        clusters = write_clusters(workdir, args.aa)
        with demo_cluster(clusters["off"], plan, workdir / "off", secret) as off, \
                demo_cluster(clusters["on"], plan, workdir / "on", secret) as on:  # fmt: skip
            served = {"off": off, "on": on}
            for base, _ in served.values():
                asyncio.run(run_load(base, 2, 2, 4, chat=True))  # warm-up
            for r in log.each_round(rounds, lambda text: console.print(f"    {text}")):
                for arm in arm_order(list(ARMS), r):
                    base, pids = served[arm]
                    cpu0 = cpu_seconds(pids)
                    res = asyncio.run(run_load(base, args.clients, requests, args.max_tokens, chat=True))
                    cpu = cpu_seconds(pids) - cpu0
                    if res.errors:
                        raise SystemExit(f"CURVE {arm}: {len(res.errors)} failed requests, e.g. {res.errors[0]}")
                    log.record(r, f"CURVE {arm} tok/s", res.tok_s, "tok/s")
                    log.record(r, f"CURVE {arm} CPU s / 1000 tokens", 1000 * cpu / max(res.tokens, 1), "s")
                log.ratio(VERDICT, "CURVE on tok/s", "CURVE off tok/s")
                log.ratio("CURVE on ÷ off, CPU per token", "CURVE on CPU s / 1000 tokens", "CURVE off CPU s / 1000 tokens")
        what = "A/A: both arms without keys" if args.aa else "CURVE on vs off"
        report(console, log, f"demo cluster (3 agents + helix serve), {what}: {args.clients} clients, "
                             f"{requests} requests x {args.max_tokens} max tokens per arm, {rounds} round(s)",
               {VERDICT: TARGET})  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
