"""PET migration vs a static task assignment (issue 19; PetS section 3.4): the ``migration`` section of
``bench/pets_balance.py``, runnable alone.

    python bench/pets_migration.py [--duration-s 180] [--shift-s 60] [--clients 24] [--tasks 16] [--rounds 1]
        [--layout replicas|pipeline] [--replica-max-batch 2] [--replica-kv-tokens 128] [--replica-cpu-share 0.4]
        [--ideal]

A cluster with replicated layers, served for real: the demo cluster's three CPU nodes, by default
(``--layout replicas``) each holding the whole model, as PetS's instances each hold it (``pipeline``:
cpu-1 and cpu-2 hold layers [0, 28) before cpu-0's last two; one core each where the box has them).
Every replica's agent is capped at ``--replica-cpu-share`` of a core (a CFS quota in a cgroup of its
own; root and a cgroup ``cpu`` controller needed; ``0``: no cap): the time a replica leaves idle is
then lost, as a GPU's is, instead of going to the coordinator and the clients, which share the box's
cores. And each runs at most ``--replica-max-batch`` requests at once (``helix agent
--max-batch-size``): a GPU saturates at its ``max_num_seqs``, while on this CPU a larger batch costs
hardly more, so without the bound a replica holding the popular tasks absorbs them in its batch and
an imbalance costs little (32 requests a replica, 24 clients: ideal ÷ static 1.16×; 2: 1.23-1.37×).
Each agent's KV holds ``--replica-kv-tokens`` (``helix agent --kv-capacity-tokens``; 128: three requests
under the coordinator's 0.85 watermark), so a replica holds the two it runs and one to start next,
and the rest wait at the coordinator (``helix serve --admission-timeout-s 600``, so that none times
out): a move then redirects its task's waiting requests, where a replica that had queued them all
would keep the backlog of a task moved away (``0``: the agent's own 65,536 tokens, every request
sent on at once).
``--tasks`` random LoRA tasks (rank 8 on q/k/v/o) are loaded with ``helix serve --task-placement
spread``: each on one replica, in turn. ``--clients`` closed-loop clients send ``--prompt-tokens``-token
prompts for ``--max-tokens`` tokens of a task drawn from a Zipf popularity (exponent ``--zipf``) whose
ranking is reshuffled every ``--shift-s`` seconds (the same schedule in every arm). The requests are
prefill-heavy, as PetS's queries (BERT-style: one forward pass each): a node's work grows with the
requests it takes. Their prompts are 32 tokens (PetS's mean).

* **static**: the spread assignment stays as loaded;
* **migration**: ``--pet-balance`` (PetS Algorithm 3, the balance judged by the replicas' mean queues;
  the interval adapts between 2 s and 20 s): the coordinator moves tasks between the replicas as
  their load drifts;
* **ideal** (``--ideal``): ``--task-placement all``, every task on every replica, routed by IWRR: what
  holding every task everywhere gains. Not a bound: IWRR routes blind to the queues, a balancer that
  reads them can pass it (the simulator's closed loop does).

Each arm starts a fresh cluster, loads the tasks, warms up for ``--warmup-s``, then counts the
requests answered over ``--duration-s`` (and the coordinator's generated tokens). Target (the
issue's): migration's throughput (requests/s) >= 1.2x static's; no request fails in either arm.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import httpx  # noqa: E402
import yaml  # noqa: E402
from elastic_cluster import Cluster  # noqa: E402
from harness import RoundLog, Target, add_rounds_option, interleaved, make_console, report  # noqa: E402

DEMO = ROOT / "clusters" / "demo" / "cluster.yaml"
LAYOUTS = {  # --layout: node -> the layers it holds
    "replicas": {"cpu-0": (0, 30), "cpu-1": (0, 30), "cpu-2": (0, 30)},  # three instances of the whole model
    "pipeline": {"cpu-0": (28, 30), "cpu-1": (0, 28), "cpu-2": (0, 28)},  # two replicas before a shared last stage
}
PINNED = {"cpu-1": [0], "cpu-2": [1], "cpu-0": [2]}  # "pipeline": a core per agent (cpu-0's only with 4 cores or more)
TARGET = 1.2
ARMS = ("static", "migration")
IDEAL = "ideal"  # every task on every node (--task-placement all)
if TYPE_CHECKING:
    from router.launch import AgentProcesses

out = make_console()


def write_cluster(workdir: Path, layout: str) -> tuple[Path, Path]:
    """The demo cluster without its layer caps and the plan of ``LAYOUTS[layout]``."""
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import finish_plan

    root = workdir / "cluster"
    shutil.copytree(DEMO.parent, root, ignore=shutil.ignore_patterns(".helix-profile-cache"))
    raw = yaml.safe_load((root / "cluster.yaml").read_text())
    for node in raw["nodes"]:
        node.pop("max_layers", None)
    (root / "cluster.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cluster = load_cluster(root / "cluster.yaml")
    plan_path = workdir / "plan.json"
    finish_plan(cluster, load_profiles_for(cluster), LAYOUTS[layout], method="manual").save(plan_path)
    return root / "cluster.yaml", plan_path


def write_tasks(root: Path, count: int) -> list[tuple[str, Path]]:
    from node_agent.config import load_config
    from node_agent.gguf_convert import cached_model_dir
    from node_agent.pet_samples import sample_tensors
    from node_agent.task_files import save_pet

    cfg = load_config(cached_model_dir())
    tasks = []
    for i in range(count):
        name = f"task-{i:02d}"
        if not (root / name / "pet_model.safetensors").is_file():
            save_pet(root / name, "lora", sample_tensors("lora", cfg, 500 + i))
        tasks.append((name, root / name))
    return tasks


class Serving(Cluster):
    """The agents of ``LAYOUTS[layout]`` (the replicas capped, and pinned in ``pipeline``) and ``helix serve
    --task-placement placement`` with ``flags`` over them."""

    def __init__(self, cluster_path: Path, plan_path: Path, workdir: Path, flags: list[str], share: float,
                 placement: str = "spread", layout: str = "replicas", max_batch: int = 0, kv_tokens: int = 0) -> None:  # fmt: skip
        self.quotas = ReplicaQuotas(share, workdir.name)
        agent_args = [*(["--max-batch-size", str(max_batch)] if max_batch else []),
                      *(["--kv-capacity-tokens", str(kv_tokens)] if kv_tokens else [])]  # fmt: skip
        super().__init__(cluster_path, plan_path, workdir, on_agents=lambda agents: _pin(agents, self.quotas, layout),
                         agent_args=agent_args,
                         flags=["--no-replan", "--task-placement", placement, "--admission-timeout-s", "600",
                                *flags])  # fmt: skip

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.quotas.remove()

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=10).json())


class ReplicaQuotas:
    """A CFS quota of ``share`` of one core for each replica agent, in a cgroup of its own (v1's ``cpu``
    controller or v2's ``cpu.max``); ``share`` 0: none."""

    V1, V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")

    def __init__(self, share: float, tag: str) -> None:
        self.share, self.tag = share, tag
        self.made: list[Path] = []

    @classmethod
    def v1(cls) -> bool:
        """Whether the quotas go through cgroup v1's ``cpu`` controller (else v2's ``cpu.max``)."""
        return (cls.V1 / "cpu.cfs_quota_us").is_file()

    @classmethod
    def check(cls) -> str | None:
        """Why quotas cannot be set here (None: they can)."""
        v1 = cls.v1()
        control = cls.V2 / "cgroup.subtree_control"
        v2 = control.is_file() and "cpu" in control.read_text().split()
        if not (v1 or v2):
            return "no cgroup cpu controller"
        return None if os.access(cls.V1 if v1 else cls.V2, os.W_OK) else "not root"

    def cap(self, node: str, pid: int) -> None:
        if self.share <= 0:
            return
        period, quota = 100_000, max(1_000, int(self.share * 100_000))
        v1 = self.v1()
        group = (self.V1 if v1 else self.V2) / f"helix-bench-{self.tag}-{node}"
        group.mkdir(exist_ok=True)
        self.made.append(group)
        if v1:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {period}")
        (group / "cgroup.procs").write_text(str(pid))  # the process and its threads, and what they start later

    def remove(self) -> None:
        for group in self.made:
            try:
                group.rmdir()  # the agents have exited: the group is empty
            except OSError:
                pass
        self.made.clear()


def _pin(agents: AgentProcesses, quotas: ReplicaQuotas, layout: str) -> None:
    """``replicas``: every agent capped at its quota, where the OS puts it. ``pipeline``: cpu-1 and cpu-2 on
    a core each, each capped at its quota (cpu-0 on a third core where there are 4 cores or more)."""
    import psutil

    if layout == "replicas":
        for node in LAYOUTS[layout]:
            quotas.cap(node, agents.agents[node].pid)
        return
    cores = os.cpu_count() or 1
    for node, pinned in PINNED.items():
        if max(pinned) < cores and (cores >= 4 or node != "cpu-0"):
            psutil.Process(agents.agents[node].pid).cpu_affinity(pinned)
        if node != "cpu-0":
            quotas.cap(node, agents.agents[node].pid)


def popularity(names: list[str], zipf: float, shift_s: float, seed: int, t: float) -> list[float]:
    """Each task's weight at ``t`` seconds: Zipf over a ranking reshuffled every ``shift_s``."""
    ranking = list(names)
    random.Random(seed * 1_000 + int(t // shift_s)).shuffle(ranking)
    rank = {name: r for r, name in enumerate(ranking)}
    return [1.0 / (rank[n] + 1) ** zipf for n in names]


def run_arm(args: argparse.Namespace, arm: str, workdir: Path, tasks: list[tuple[str, Path]], seed: int) -> dict[str, Any]:
    cluster_path, plan_path = write_cluster(workdir, args.layout)
    flags = ["--pet-balance", "--pet-balance-interval-s", "2", "20", "--pet-balance-min-requests",
             str(args.min_requests)] if arm == "migration" else []  # fmt: skip
    serving = Serving(cluster_path, plan_path, workdir, flags, args.replica_cpu_share,
                      placement="all" if arm == IDEAL else "spread", layout=args.layout,
                      max_batch=args.replica_max_batch, kv_tokens=args.replica_kv_tokens)  # fmt: skip
    errors: list[str] = []
    answered: list[float] = []  # when each request was answered
    try:
        with httpx.Client(base_url=serving.url, timeout=600) as http:
            for name, path in tasks:
                response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: {response.text}")
        names = [n for n, _ in tasks]
        stop = threading.Event()
        t0 = time.monotonic()

        def client(i: int) -> None:
            rng = random.Random(seed * 100 + i)
            with httpx.Client(base_url=serving.url, timeout=600) as http:
                while not stop.is_set():
                    name = rng.choices(names, popularity(names, args.zipf, args.shift_s, seed, time.monotonic() - t0))[0]
                    prompt = [rng.randrange(100, 49_000) for _ in range(args.prompt_tokens)]
                    body = {"model": name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                    try:
                        response = http.post("/v1/completions", json=body)
                        response.raise_for_status()
                        answered.append(time.monotonic())
                    except httpx.HTTPError as exc:
                        errors.append(f"{name}: {exc!r}")

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup_s)
        start_tokens, start = serving.tokens(), time.monotonic()
        time.sleep(args.duration_s)
        end = time.monotonic()
        tok_s = (serving.tokens() - start_tokens) / (end - start)
        req_s = sum(start <= t < end for t in answered) / (end - start)
        balance = serving.health().get("pet_balance")
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        serving.close()
    return {"req_s": req_s, "tok_s": tok_s, "errors": errors, "answered": len(answered), "balance": balance}


def bench_migration(args: argparse.Namespace) -> None:
    if args.replica_cpu_share > 0 and (why := ReplicaQuotas.check()) is not None:
        raise SystemExit(f"--replica-cpu-share {args.replica_cpu_share}: cannot cap the replicas' CPU here ({why}); "
                         "run as root, or pass --replica-cpu-share 0")
    log = RoundLog()
    workdir = Path(tempfile.mkdtemp(prefix="helix-pets-migration-"))
    try:
        tasks = write_tasks(workdir / "tasks", args.tasks)
        for r, arm in interleaved((*ARMS, *([IDEAL] if args.ideal else [])), args.rounds):
            out.print(f"[dim]migration: round {r + 1}, {arm} ({args.warmup_s + args.duration_s:.0f} s)...[/]")
            result = run_arm(args, arm, workdir / f"{arm}-{r}", tasks, seed=r + 1)
            out.print(f"  {arm}: {result['req_s']:.2f} requests/s, {result['tok_s']:.1f} tok/s, {result['answered']} answered, "
                      f"{len(result['errors'])} failed" + (f", balance {result['balance']}" if result["balance"] else ""))
            for error in result["errors"][:3]:
                out.print(f"[red]  failed: {error}[/]")
            log.record(r, f"{arm} requests/s", result["req_s"], "/s")
            log.record(r, f"{arm} failed requests", len(result["errors"]), "")
        log.ratio("migration ÷ static throughput", "migration requests/s", "static requests/s")
        if args.ideal:
            log.ratio("ideal ÷ static throughput (the ceiling)", "ideal requests/s", "static requests/s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cap = f", replicas capped at {args.replica_cpu_share:g} core each" if args.replica_cpu_share > 0 else ""
    report(out, log, f"PET migration vs static, {args.layout} layout, {args.tasks} tasks, Zipf {args.zipf} reshuffled every "
                     f"{args.shift_s:.0f} s, {args.clients} clients, {args.duration_s:.0f} s per arm{cap}", {
        "migration ÷ static throughput": Target(">=", TARGET),
        "static failed requests": Target("<=", 0),
        "migration failed requests": Target("<=", 0),
    })  # fmt: skip


def add_migration_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--duration-s", type=float, default=180.0, help="measured seconds per arm (default 180)")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="seconds of load before measuring (default 20)")
    ap.add_argument("--shift-s", type=float, default=60.0, help="the popularity is reshuffled this often (default 60)")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the tasks' popularity (default 1.1)")
    ap.add_argument("--clients", type=int, default=24, help="closed-loop clients (default 24)")
    ap.add_argument("--tasks", type=int, default=16, help="LoRA tasks (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt, random ids (default 32)")
    ap.add_argument("--min-requests", type=int, default=24,
                    help="helix serve --pet-balance-min-requests in the migration arm (default 24)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per answer (default 4)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="replicas",
                    help="replicas (default): cpu-0, cpu-1 and cpu-2 each hold the whole model, PetS's instances; "
                         "pipeline: cpu-1 and cpu-2 hold layers [0, 28) before cpu-0's last two")
    ap.add_argument("--replica-max-batch", type=int, default=2,
                    help="helix agent --max-batch-size of every agent (default 2; 0: the agent's own, 32)")
    ap.add_argument("--replica-kv-tokens", type=int, default=128,
                    help="helix agent --kv-capacity-tokens of every agent (default 128: three requests of 36 tokens "
                         "under the coordinator's 0.85 watermark, so the rest wait at the coordinator; 0: the agent's own)")
    ap.add_argument("--ideal", action="store_true", help="add the ideal arm: every task on both replicas")
    ap.add_argument("--replica-cpu-share", type=float, default=0.4,
                    help="cap the replicas' agents at this share of a core each (a cgroup CPU quota; root; "
                         "0: no cap; default 0.4)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_migration_arguments(ap)
    add_rounds_option(ap, 1, "a round runs both arms, each on a fresh cluster (about 8 minutes)")
    bench_migration(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
