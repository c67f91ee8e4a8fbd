"""``helix profile``: measure a cluster (engine + ZeroMQ), or estimate GPUs from spec sheets.

* ``helix profile --cluster CLUSTER [--force] [-o PROFILES]`` measures the cluster on this
  machine (:mod:`profiler.cluster_profile`), writes the result to ``-o`` (default
  ``profiles-measured.yaml`` next to the cluster, never over its own files) and
  ``links-measured.yaml`` beside it; a rerun is instant from the cache (in the user's cache dir).
* ``--kv-requests``/``--kv-context-tokens`` or ``--kv-reserve-gb`` choose the KV reserve that
  decides every GPU's ``max_layers`` (:mod:`profiler.kv_reserve`); ``--estimate`` prints what
  limits each GPU.
* ``helix profile --estimate --gpus A100,L4,T4 --model llama-2-70b -o profiles.yaml`` writes
  roofline estimates (:mod:`profiler.roofline`); ``--model-config`` takes a ``config.json``
  instead of a built-in model, and ``--cluster`` with ``--estimate`` takes the GPU types and
  model from a cluster file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from helix.console import print_table
from helix.errors import ConfigError
from helix.perf_model import CostCurve
from helix.profile import ProfileSet
from helix.spec import load_cluster
from profiler.files import LINKS_FILE_NAME, MEASURED_PROFILES_NAME
from profiler.kv_capacity import DEFAULT_MIN_KV_TOKENS_PER_LAYER, default_reserve
from profiler.kv_reserve import DEFAULT_KV_CONTEXT_TOKENS, DEFAULT_KV_REQUESTS, KvReserve


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="CLUSTER", help="cluster YAML to measure (or, with --estimate, to estimate)")
    p.add_argument("--estimate", action="store_true", help="roofline estimates from spec sheets instead of measuring")
    p.add_argument("--gpus", metavar="A,B,..", help="GPU names for --estimate (e.g. A100,L4,T4,H100)")
    p.add_argument("--model", metavar="NAME", help="built-in model for --estimate (e.g. llama-2-70b)")
    p.add_argument("--model-config", metavar="PATH", help="config.json (or YAML) of the model for --estimate")
    p.add_argument("--dtype-bytes", type=int, metavar="N", help="bytes per weight/KV value for --estimate (default 2)")
    kv = p.add_argument_group(
        "KV reserve (what decides max_layers)",
        "A GPU may hold k layers when their weights and the KV reserve fit its memory. Give a target load "
        "(--kv-requests x --kv-context-tokens of KV in every layer held) or a fixed --kv-reserve-gb per GPU. "
        f"Default: {DEFAULT_KV_REQUESTS} requests x {DEFAULT_KV_CONTEXT_TOKENS} tokens with --estimate "
        f"(the paper's A100/L4/T4 limits), {DEFAULT_MIN_KV_TOKENS_PER_LAYER} tokens per layer when measuring "
        "(the agent's --kv-capacity-tokens).",
    )
    add_kv_reserve_arguments(kv)
    p.add_argument("-o", "--output", metavar="PROFILES",
                   help="profiles file to write; an existing one is merged into (its other entries kept). "
                        "--estimate: without -o the estimate is only printed. Measuring: default "
                        f"{MEASURED_PROFILES_NAME} next to the cluster (never the cluster's own profiles files "
                        f"unless you name one here); the measured links go to {LINKS_FILE_NAME} beside it")
    p.add_argument("--force", action="store_true", help="measure again even if the cache has results")
    p.add_argument("--model-dir", metavar="DIR", help="engine model dir to measure (default: SmolLM2-135M)")
    p.add_argument("--no-links", action="store_true", help="do not measure links")
    p.add_argument("--backend", choices=["torch", "vllm"], default="torch",
                   help="measure through this engine backend (vllm: vLLM's layers, docs/gpu.md)")
    p.add_argument("--concurrent", action="store_true",
                   help="measure every co-located node at the same time (they share cores when serving)")


def add_kv_reserve_arguments(group: argparse._ArgumentGroup) -> None:
    """The KV-reserve options (``profile`` and ``init`` take the same; :func:`kv_reserve_from` reads them)."""
    group.add_argument("--kv-requests", type=int, metavar="N",
                       help=f"concurrent requests a node keeps KV for in every layer it holds (default {DEFAULT_KV_REQUESTS})")
    group.add_argument("--kv-context-tokens", type=int, metavar="T",
                       help=f"context tokens (prompt + output) of each of those requests (default {DEFAULT_KV_CONTEXT_TOKENS})")
    group.add_argument("--kv-reserve-gb", type=float, metavar="GB",
                       help="instead: keep GB (10^9 bytes) of every GPU for KV whatever it holds")


def kv_reserve_from(args: argparse.Namespace, default: KvReserve) -> KvReserve:
    """The KV reserve the options ask for (``default`` when none is given)."""
    requests, context, gb = args.kv_requests, args.kv_context_tokens, args.kv_reserve_gb
    if gb is not None:
        if requests is not None or context is not None:
            raise ConfigError("give either --kv-reserve-gb or --kv-requests/--kv-context-tokens, not both",
                              field="--kv-reserve-gb")  # fmt: skip
        if gb < 0:
            raise ConfigError(f"must be 0 or more, got {gb:g}", field="--kv-reserve-gb")
        return KvReserve.fixed_gb(gb)
    for flag, value in (("--kv-requests", requests), ("--kv-context-tokens", context)):
        if value is not None and value < 1:
            raise ConfigError(f"must be 1 or more, got {value}", field=flag)
    if requests is None and context is None:
        return default
    return KvReserve.for_requests(requests or DEFAULT_KV_REQUESTS, context or DEFAULT_KV_CONTEXT_TOKENS)


def run_profile(args: argparse.Namespace) -> int:
    if args.estimate:
        return _run_estimate(args)
    if not args.cluster:
        raise ConfigError("give --cluster CLUSTER to measure, or --estimate --gpus ... to estimate", field="--cluster")
    return _run_measure(args)


# -- estimate ------------------------------------------------------------------------------------


def _run_estimate(args: argparse.Namespace) -> int:
    from profiler.gpus import gpu_spec, load_model_shape
    from profiler.roofline import Roofline, estimate_profiles

    cluster = load_cluster(args.cluster) if args.cluster else None
    model_arg = args.model_config or args.model or (cluster.model if cluster else None)
    if model_arg is None:
        raise ConfigError("give --model NAME or --model-config PATH", field="--model")
    given_as = "--model-config" if args.model_config else "--model" if args.model else f"{args.cluster}: model"
    shape = load_model_shape(model_arg, dtype_bytes=args.dtype_bytes, given_as=given_as)
    if cluster is not None and args.model is None and args.model_config is None:
        shape = type(shape)(**{**{f: getattr(shape, f) for f in shape.__slots__}, "name": cluster.model})
    if args.gpus:
        names = [g.strip() for g in args.gpus.split(",") if g.strip()]
    elif cluster is not None:
        names = sorted({n.gpu for n in cluster.nodes})
    else:
        raise ConfigError("give --gpus A100,L4,... (or --cluster)", field="--gpus")
    roofline = Roofline(kv_reserve=kv_reserve_from(args, KvReserve()))
    specs = {name: gpu_spec(name) for name in names}
    profiles = estimate_profiles(specs, shape, roofline)
    console = Console(highlight=False)
    print_profiles(console, profiles, title=f"roofline estimate: {shape.name}")
    console.print(f"layer limits with a {roofline.kv_reserve.describe()}:")
    for name, spec in specs.items():
        console.print(f"  {name} ({spec.vram_gb:g} GB VRAM): {roofline.layer_limit(spec, shape).explain()}")
    if args.output:
        from helix.profile import load_profile_file
        from profiler.files import write_profiles

        if Path(args.output).is_file():  # keep what else the file holds (this estimate wins)
            profiles = load_profile_file(args.output).merged(profiles)
        write_profiles(args.output, profiles, f"Roofline estimates (helix profile --estimate) for {shape.name}.\n"
                       f"max_layers of {', '.join(names)} keeps the {roofline.kv_reserve.describe()}.\n"
                       "See docs/profiler.md for the model; latency curves are per ONE layer.")  # fmt: skip
        console.print(f"profiles written to [bold]{args.output}[/]")
    return 0


def print_profiles(console: Console, profiles: ProfileSet, *, title: str) -> None:
    """One row per GPU and model: layer limit, a few latency points, KV, derived tokens/s."""
    table = Table(title=title)
    for col in ("GPU", "model", "max layers", "prefill ms/L @1k tok", "decode ms/L @b=1", "@b=32",
                "KV tok (1 L)", "tok/s (1 L)", "tok/s (max L)"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("GPU", "model") else "right")
    for gpu, gp in profiles.gpus.items():
        for model, tp in gp.throughput.items():
            tok = tp.tok_s_table(profiles.models[model])
            pre = _at(tp.prefill_ms_per_layer, 1024)
            d1, d32 = _at(tp.decode_ms_per_layer, 1), _at(tp.decode_ms_per_layer, 32)
            kv = tp.kv_capacity_tokens_by_layers[0] if tp.kv_capacity_tokens_by_layers else float("nan")
            table.add_row(gpu, model, str(tp.max_layers), f"{pre:.2f}", f"{d1:.3f}", f"{d32:.3f}", f"{kv:,.0f}",
                          f"{tok[0]:,.0f}", f"{tok[-1]:,.0f}")  # fmt: skip
    print_table(console, table)


def _at(curve: list[tuple[float, float]] | None, x: float) -> float:
    """A latency curve at ``x`` as the planner and the simulator read it (nan without one)."""
    return CostCurve(curve).at(x) if curve else float("nan")


# -- measure -------------------------------------------------------------------------------------


def _run_measure(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from profiler.cluster_profile import profile_cluster
    from profiler.measure import MeasureSettings

    cluster = load_cluster(args.cluster)
    if args.model_dir is not None and not Path(args.model_dir).is_dir():
        raise ConfigError("model directory not found", source=args.model_dir, field="--model-dir")
    console = Console(highlight=False)
    columns = (SpinnerColumn(), TextColumn("[bold]{task.fields[phase]}[/] {task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting", phase="profile")

        def notify(phase: str, message: str) -> None:
            progress.update(task, description=message, phase=phase)

        result = profile_cluster(cluster, model_dir=args.model_dir, force=args.force, output=args.output,
                                 measure_links=not args.no_links, notify=notify, concurrent=args.concurrent,
                                 kv_reserve=kv_reserve_from(args, default_reserve()),
                                 settings=MeasureSettings(backend=args.backend))  # fmt: skip
    measured = {g: result.profiles.gpus[g] for g in (*result.measured, *result.cache_hits)}
    print_profiles(console, ProfileSet(models=result.profiles.models, gpus=measured),
                   title=f"{cluster.name}: measured on this machine")  # fmt: skip
    if result.links:
        table = Table(title="links (ZeroMQ: bulk transfer + ping)")
        for col in ("src", "dst", "bandwidth Gbit/s", "latency ms"):
            table.add_column(col, justify="left" if col in ("src", "dst") else "right")
        for m in result.links:
            table.add_row(m.src, m.dst, f"{m.bandwidth_gbps:.2f}", f"{m.latency_ms:.3f}")
        print_table(console, table)
    cached = f" (cache hits: {', '.join(result.cache_hits)})" if result.cache_hits else ""
    console.print(f"profiles written to [bold]{result.profiles_path}[/]{cached}")
    listed = {p.resolve() for p in cluster.profile_paths()}
    if result.profiles_path.resolve() not in listed:
        console.print(f"to plan with them, list it last in {cluster.source}'s profiles: (later files win), "
                      f"or pass one of its profiles files as -o to merge the measurements into it")  # fmt: skip
    if result.links_path:
        console.print(f"measured links written to [bold]{result.links_path}[/] (paste them into the cluster's links:)")
    if result.skipped_nodes:
        console.print(f"[yellow]not on this machine, not measured:[/] {', '.join(result.skipped_nodes)}")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"done in {result.wall_s:.1f} s")
    return 0
