"""``helix agent``: start one node agent of a planned cluster (also ``python -m node_agent``).

The node's layer range comes from the plan's placement (``--no-layers``: none yet, the coordinator
gives it one with SET_LAYERS while the agent serves); the control socket binds to ``--bind``,
else the node's ``address`` in the cluster file, else a free loopback port. The data socket binds
to ``--data-bind`` or a free port on the same host. The shared secret is read from the
environment variable named by ``--secret-env``; without one the agent only binds to loopback.
When the cluster file names CURVE keys (``keys_dir`` or ``public_key``; ``helix keys`` writes
them), every socket runs CURVE with the node's secret certificate (``--key``, default
``<keys_dir>/<node>.key_secret``) and no shared secret is needed; beyond loopback without keys
the agent warns that its links are neither encrypted nor authenticated. Once serving, the agent prints one line ``READY node=... control=... data=...`` to stdout.
SIGTERM makes it leave: it drains for up to ``--drain-timeout-s`` (:mod:`node_agent.membership`),
then exits 0; a second SIGTERM, or SIGINT, stops it at once.

``--batching alpha|beta|coordinated`` chooses which requests join each step by their fine-tuned tasks
(:mod:`node_agent.batching`; default ``fcfs``), priced by the node's GPU profile (its shared-op curves
and ``pet_ms_per_layer``, from ``helix profile``); ``--max-passed-over-steps`` bounds how many steps
a request can be passed over.

``--join URL`` (with ``--gpu``) starts a node joining a running cluster: no ``--plan``, the node
need not be in the cluster file, no layers yet (``--no-layers``); once up it asks the coordinator
at URL to take it in (:mod:`node_agent.join`), which dials it and gives it layers with SET_LAYERS.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helix.addresses import LOOPBACK_HOSTS, any_port, host_of
from helix.errors import ConfigError, EngineError
from node_agent.batching import DEFAULT_MAX_PASSED_OVER_STEPS, FCFS, BatchingMode, BatchingPolicy

if TYPE_CHECKING:
    from helix.keys import KeyPair, PeerPolicy
    from helix.plan import Plan
    from helix.spec import ClusterSpec, NodeSpec
    from node_agent.backends import StageBackend

log = logging.getLogger(__name__)


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster YAML")
    p.add_argument("--plan", help="plan file (placement gives this node's layers); not with --join")
    p.add_argument("--node", required=True, help="this node's id in the cluster")
    p.add_argument("--model-dir", help="HF-style model dir (config.json + safetensors); default: SmolLM2-135M")
    p.add_argument("--bind", help="control socket address (default: the node's address, else tcp://127.0.0.1:*)")
    p.add_argument("--data-bind", help="data socket address (default: a free port on the control host)")
    p.add_argument("--secret-env", default="HELIX_SECRET", help="env var holding the shared secret")
    p.add_argument("--key", metavar="FILE",
                   help="this node's CURVE secret certificate, when the cluster file names keys "
                        "(default: <keys_dir>/<node>.key_secret; `helix keys` writes it)")
    p.add_argument("--kv-capacity-tokens", type=int, default=65536,
                   help="KV cache of this stage in tokens (a request reserves prompt + max_tokens up front)")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests running in one engine step")
    p.add_argument("--token-budget", type=int, default=512,
                   help="most tokens (decodes + prefill chunk) in one engine step; at least --max-batch-size")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (0 = no chunking)")
    p.add_argument("--batching", choices=[m.value for m in BatchingMode], default=BatchingMode.FCFS.value,
                   help="which requests join a step when they run fine-tuned tasks: fcfs (arrival order), "
                        "coordinated (PetS: tasks grouped, priced by the profile's shared-op curves and "
                        "pet_ms_per_layer), or PetS's baselines alpha and beta (docs/pets.md)")
    p.add_argument("--max-passed-over-steps", type=int, default=DEFAULT_MAX_PASSED_OVER_STEPS,
                   help="with --batching other than fcfs: the most steps a request that could run is passed over")
    p.add_argument("--wire-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of activations sent to the next stage (bfloat16 halves the bytes)")
    p.add_argument("--max-frame-bytes", type=int, default=64 << 20, help="largest wire frame accepted")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 when several agents share a host)")
    p.add_argument("--gather-window-ms", type=float,
                   help="an idle engine woken by an arrival waits this long for the rest of the burst "
                        "(default: AgentConfig's, 3 ms; 0: never)")
    p.add_argument("--backend", choices=["torch", "vllm"],
                   help="what runs the layers: torch (Helix's engine) or vllm (vLLM's layers; docs/gpu.md) "
                        "(default: the node's `backend` in the cluster file, else torch)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (default: the node's `dtype` in the cluster file, else float32)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where to compute (default: the node's `device` in the cluster file, else cpu)")
    p.add_argument("--no-layers", action="store_true",
                   help="start holding no layers (a node joining a running cluster: the coordinator assigns its "
                        "range with SET_LAYERS); the node need not be in the plan's placement")
    p.add_argument("--join", metavar="URL",
                   help="join the running cluster of the coordinator at URL (http://HOST:PORT): start with no "
                        "layers and ask it to take this node in (needs --gpu; the node need not be in the cluster "
                        "file; the shared secret authenticates it as any agent)")
    p.add_argument("--gpu", help="with --join: this node's GPU type (a key of the profiles' gpus)")
    p.add_argument("--region", help="with --join: this node's region (default: the coordinator's)")
    p.add_argument("--api-key-env", default="HELIX_API_KEY",
                   help="with --join: env var holding the coordinator's API key, when it requires one")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM the agent takes no new requests and finishes those it runs within this long, "
                        "refuses the rest (retryable: the coordinator re-prefills them elsewhere) and exits")
    p.add_argument("--max-weight-bytes", type=int,
                   help="the most bytes of weights SET_LAYERS may bring this agent to (default: what the device "
                        "has free)")
    p.add_argument("--step-log", metavar="FILE",
                   help="write one JSON line per engine step (time, CPU, batch by layer) to FILE; {node} is replaced")


def run_agent(args: argparse.Namespace) -> int:
    from helix.loading import load_model
    from helix.plan import Plan
    from helix.spec import NodeSpec, load_cluster

    cluster = load_cluster(args.cluster)
    plan: Plan | None = None
    if args.join:
        if not args.gpu:
            raise ConfigError("--join needs --gpu, the node's GPU type (a key of the profiles' gpus)", field="--gpu")
        node = cluster.node(args.node) if args.node in cluster.node_ids else \
            NodeSpec(id=args.node, gpu=args.gpu, region=args.region)
        start, end = 0, 0
    elif not args.plan:
        raise ConfigError("give the plan (--plan), or --join a running cluster", field="--plan")
    else:
        node = cluster.node(args.node)
        plan = load_model(Plan, args.plan)
        if args.no_layers:
            start, end = 0, 0
        elif args.node not in plan.placement:
            raise ConfigError(f"node {args.node!r} holds no layers in this plan (--no-layers: start with none)",
                              source=args.plan, field="placement")  # fmt: skip
        else:
            start, end = plan.placement[args.node]
    control = args.bind or node.address or "tcp://127.0.0.1:*"
    data = args.data_bind or any_port(control)
    secret = os.environ.get(args.secret_env, "")
    security = agent_security(cluster, plan, args.node, args.key, [control, data])
    beyond_loopback = host_of(control) not in LOOPBACK_HOSTS or host_of(data) not in LOOPBACK_HOSTS
    if not secret and not security["peers"].curve:
        if beyond_loopback:
            raise ConfigError(f"binding {control} beyond loopback needs CURVE keys in the cluster file (`helix keys`) "
                              f"or a shared secret in ${args.secret_env}", field="--secret-env")  # fmt: skip
        log.warning("no shared secret in $%s: accepting coordinators on loopback only", args.secret_env)
    elif beyond_loopback and not security["peers"].curve:
        log.warning("binding %s beyond loopback without CURVE keys: activations and tokens travel unencrypted and "
                    "anyone who reaches the data port can send activations (run `helix keys`, docs/gpu.md)", control)
    for flag, value in (("--gather-window-ms", args.gather_window_ms), ("--drain-timeout-s", args.drain_timeout_s),
                        ("--max-weight-bytes", args.max_weight_bytes)):  # fmt: skip
        if value is not None and value < 0:
            raise ConfigError(f"must be 0 or more, got {value}", field=flag)
    if args.model_dir is not None and not Path(args.model_dir).is_dir():
        raise EngineError(f"{args.model_dir}: model directory not found (--model-dir)")
    if plan is not None and plan.model != cluster.model:
        raise ConfigError(f"the plan is for model {plan.model!r} but the cluster {args.cluster} serves "
                          f"{cluster.model!r}", source=args.plan, field="model")  # fmt: skip
    model_dir = args.model_dir or str(_default_model_dir())
    from node_agent.backends import StageBackend, check_backend

    backend = StageBackend(args.backend or node.backend, args.dtype or node.dtype, args.device or node.device)
    check_backend(args.node, backend, model_dir)
    check_weights(cluster, model_dir, node=args.node, layers=(start, end), plan_source=args.plan or args.cluster)
    join = None
    if args.join:
        if security["peers"].curve:
            raise ConfigError("nodes join only a cluster without CURVE keys (its agents' keys are fixed at start)",
                              field="--join")  # fmt: skip
        from node_agent.join import JoinRequest

        join = JoinRequest(args.join, args.node, args.gpu, region=args.region or node.region,
                           api_key=os.environ.get(args.api_key_env, ""))  # fmt: skip
    batching = batching_policy(cluster, node, args.batching, args.max_passed_over_steps, end - start)
    return serve_agent(node_id=args.node, layer_start=start, layer_end=end, model_dir=model_dir,
                       control_bind=control, data_bind=data, secret=secret.encode(),
                       kv_capacity_tokens=args.kv_capacity_tokens, max_batch_size=args.max_batch_size,
                       token_budget=args.token_budget, chunk_size=args.chunk_size or None, batching=batching,
                       wire_dtype=args.wire_dtype, threads=args.threads, max_frame_bytes=args.max_frame_bytes,
                       step_log=args.step_log.replace("{node}", args.node) if args.step_log else None,
                       gather_window_ms=args.gather_window_ms, backend=backend, drain_timeout_s=args.drain_timeout_s,
                       max_weight_bytes=args.max_weight_bytes, on_ready=join.start if join else None,
                       **security)  # fmt: skip


def batching_policy(cluster: ClusterSpec, node: NodeSpec, mode: str, max_passed_over_steps: int,
                    layers: int) -> BatchingPolicy:  # fmt: skip
    """The batching policy ``--batching`` names, its cost models from the node's GPU profile over ``layers``
    (none yet: as many as the node may hold); ConfigError naming the profile when a mode other than fcfs
    lacks the curves it prices with."""
    from helix.profile import load_profiles_for, node_max_layers
    from node_agent.batching import StepCostModel

    if max_passed_over_steps < 1:
        raise ConfigError(f"must be 1 or more, got {max_passed_over_steps}", field="--max-passed-over-steps")
    if mode == BatchingMode.FCFS:
        return FCFS
    profiles = load_profiles_for(cluster)
    tp = profiles.throughput(node.gpu, cluster.model)
    curves = tp.curves()
    where = ", ".join(str(p) for p in cluster.profile_paths())
    if curves is None or not curves.pet:
        lacks = "prefill_ms_per_layer and decode_ms_per_layer" if curves is None else "pet_ms_per_layer"
        raise ConfigError(f"--batching {mode} prices steps with GPU type {node.gpu!r}'s measured curves, but its "
                          f"profile for {cluster.model!r} has no {lacks} (measure it: helix profile --cluster ...)",
                          source=where, field="--batching")  # fmt: skip
    return BatchingPolicy(BatchingMode(mode), max_passed_over_steps,
                          StepCostModel(curves, layers or node_max_layers(node, tp)))


def agent_security(cluster: ClusterSpec, plan: Plan | None, node: str, key_file: str | None,
                   binds: list[str]) -> dict[str, Any]:  # fmt: skip
    """The agent's peer policy, key pair and predecessors (AgentConfig's fields) for ``node``: the key pair
    from ``key_file`` or ``<keys_dir>/<node>.key_secret`` when the cluster names keys; ConfigError naming
    the flag or file when it is missing, is not the node's, or the node binds where the file does not put it."""
    from helix.keys import own_key_pair, peer_policy, predecessors

    policy = peer_policy(cluster)
    if not policy.curve:
        if key_file:
            raise ConfigError("the cluster file names no CURVE keys (`keys_dir` or `public_key`): nothing to use "
                              "the key for", source=cluster.source, field="--key")  # fmt: skip
        return {"peers": policy, "key_pair": None, "predecessors": frozenset()}
    key_pair = own_key_pair(cluster, node, key_file, policy.public_keys)
    allowed = policy.hosts.get(node)
    for bind in binds:
        if allowed is not None and host_of(bind) not in allowed:
            raise ConfigError(f"node {node!r} would bind {bind}, but its peers send to {', '.join(sorted(allowed))} "
                              f"only (its address in the cluster file, loopback without one)", source=cluster.source,
                              field="--bind")  # fmt: skip
    senders = predecessors(plan.placement, node, partial_handoffs=plan.partial_handoffs,
                           links=set(cluster.resolved_links())) if plan and node in plan.placement else set()  # fmt: skip
    return {"peers": policy, "key_pair": key_pair, "predecessors": frozenset(senders)}


def _default_model_dir() -> Path:
    from node_agent.gguf_convert import cached_model_dir

    return cached_model_dir()


def check_weights(cluster: ClusterSpec, model_dir: str, *, node: str, layers: tuple[int, int],
                  plan_source: str) -> None:  # fmt: skip
    """Before anything loads: the weights are the cluster's model (layer count and hidden size
    from the cluster's profiles) and hold the node's layers. Without readable profiles that
    name the model, only the layer range can be checked, and a warning says so."""
    from helix.profile import ProfileSet, load_profile_file
    from node_agent.config import check_serves, load_config

    config = load_config(model_dir)
    paths = cluster.profile_paths()
    where = ", ".join(str(p) for p in paths)
    missing = [str(p) for p in paths if not p.is_file()]
    profiles = ProfileSet()
    for path in paths:
        if path.is_file():
            profiles = profiles.merged(load_profile_file(path))
    expected = profiles.models.get(cluster.model)
    if expected is not None:
        check_serves(config, model_dir, model=cluster.model, num_layers=expected.num_layers,
                     hidden_size=expected.hidden_size, where=where)  # fmt: skip
    else:
        why = f"profiles file not found: {', '.join(missing)}" if missing else f"{where} does not describe it"
        log.warning("cannot check that the weights in %s (%s) are the cluster's model %r: %s", model_dir,
                    config.name, cluster.model, why)  # fmt: skip
    start, end = layers
    if end > config.num_layers:
        raise EngineError(
            f"{plan_source}: node {node!r} holds layers [{start}, {end}) of {cluster.model!r} but the weights in "
            f"{model_dir} are {config.name!r} with {config.num_layers} layers; pass --model-dir with "
            f"the weights of {cluster.model!r}"
        )


def serve_agent(*, node_id: str, layer_start: int, layer_end: int, model_dir: str | None, control_bind: str,
                data_bind: str, secret: bytes, kv_capacity_tokens: int = 65536, max_batch_size: int = 32,
                token_budget: int = 512, chunk_size: int | None = 256, batching: BatchingPolicy = FCFS,
                wire_dtype: str = "float32", threads: int = 1, max_frame_bytes: int = 64 << 20,
                step_log: str | None = None, gather_window_ms: float | None = None,
                backend: StageBackend | None = None,
                peers: PeerPolicy | None = None, key_pair: KeyPair | None = None,
                predecessors: frozenset[str] = frozenset(), drain_timeout_s: float = 30.0,
                max_weight_bytes: int | None = None, on_ready: Callable[[str], object] | None = None) -> int:
    """Load the stage (``layer_start == layer_end``: no layers yet), bind, print READY (then
    ``on_ready(control address)``), serve until SIGTERM (drain, then stop) or SIGINT."""
    import torch

    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.engine import StageEngine
    from node_agent.gguf_convert import cached_model_dir
    from node_agent.scheduler import SchedulerConfig

    torch.set_num_threads(threads)
    model_dir = model_dir or str(cached_model_dir())
    engine = StageEngine(model_dir, layer_start, layer_end, kv_capacity_tokens=kv_capacity_tokens,
                         scheduler=SchedulerConfig(max_batch_size=max_batch_size, token_budget=token_budget,
                                                   chunk_size=chunk_size, batching=batching),
                         backend=backend)  # fmt: skip
    gather = {} if gather_window_ms is None else {"gather_window_s": gather_window_ms / 1000}
    config = AgentConfig(node_id=node_id, control_bind=control_bind, data_bind=data_bind, secret=secret,
                         wire_dtype=wire_dtype, max_frame_bytes=max_frame_bytes, torch_threads=threads,
                         step_log=step_log, peers=peers, key_pair=key_pair, predecessors=predecessors,
                         drain_timeout_s=drain_timeout_s, max_weight_bytes=max_weight_bytes, **gather)
    agent = NodeAgent(config, engine)
    agent.install_signals()
    print(f"READY node={node_id} layers={layer_start}:{layer_end} backend={engine.backend.name} control={agent.control_address} "
          f"data={agent.data_address}", flush=True)  # fmt: skip
    if on_ready is not None:
        on_ready(agent.control_address)
    agent.run()
    log.info("agent %s stopped (%d steps, %d tokens, %d rejected)", node_id, agent.stats.steps,
             agent.stats.tokens, agent.stats.rejected)
    return 1 if agent.failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m node_agent``: the same as ``helix agent``."""
    from helix.cli import main as cli_main

    return cli_main(["agent", *(sys.argv[1:] if argv is None else argv)])
