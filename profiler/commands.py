"""``helix profile``: measure a cluster (engine + ZeroMQ), or estimate GPUs from spec sheets.

* ``helix profile --cluster CLUSTER [--force]`` measures the cluster on this machine
  (:mod:`profiler.cluster_profile`), merges the result into the cluster's profiles file and
  writes ``links-measured.yaml`` next to it; a rerun is instant from the cache.
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

from helix.errors import ConfigError
from helix.profile import ProfileSet
from helix.spec import load_cluster


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="CLUSTER", help="cluster YAML to measure (or, with --estimate, to estimate)")
    p.add_argument("--estimate", action="store_true", help="roofline estimates from spec sheets instead of measuring")
    p.add_argument("--gpus", metavar="A,B,..", help="GPU names for --estimate (e.g. A100,L4,T4,H100)")
    p.add_argument("--model", metavar="NAME", help="built-in model for --estimate (e.g. llama-2-70b)")
    p.add_argument("--model-config", metavar="PATH", help="config.json (or YAML) of the model for --estimate")
    p.add_argument("--dtype-bytes", type=int, metavar="N", help="bytes per weight/KV value for --estimate (default 2)")
    p.add_argument("-o", "--output", metavar="PROFILES", help="profiles file to write (measuring: merged into it)")
    p.add_argument("--force", action="store_true", help="measure again even if the cache has results")
    p.add_argument("--model-dir", metavar="DIR", help="engine model dir to measure (default: SmolLM2-135M)")
    p.add_argument("--no-links", action="store_true", help="do not measure links")
    p.add_argument("--concurrent", action="store_true",
                   help="measure every co-located node at the same time (they share cores when serving)")


def run_profile(args: argparse.Namespace) -> int:
    if args.estimate:
        return _run_estimate(args)
    if not args.cluster:
        raise ConfigError("give --cluster CLUSTER to measure, or --estimate --gpus ... to estimate", field="--cluster")
    return _run_measure(args)


# -- estimate ------------------------------------------------------------------------------------


def _run_estimate(args: argparse.Namespace) -> int:
    from profiler.gpus import gpu_spec, load_model_shape
    from profiler.roofline import estimate_profiles

    cluster = load_cluster(args.cluster) if args.cluster else None
    model_arg = args.model_config or args.model or (cluster.model if cluster else None)
    if model_arg is None:
        raise ConfigError("give --model NAME or --model-config PATH", field="--model")
    shape = load_model_shape(model_arg, dtype_bytes=args.dtype_bytes)
    if cluster is not None and args.model is None and args.model_config is None:
        shape = type(shape)(**{**{f: getattr(shape, f) for f in shape.__slots__}, "name": cluster.model})
    if args.gpus:
        names = [g.strip() for g in args.gpus.split(",") if g.strip()]
    elif cluster is not None:
        names = sorted({n.gpu for n in cluster.nodes})
    else:
        raise ConfigError("give --gpus A100,L4,... (or --cluster)", field="--gpus")
    profiles = estimate_profiles({name: gpu_spec(name) for name in names}, shape)
    console = Console(highlight=False)
    print_profiles(console, profiles, title=f"roofline estimate: {shape.name}")
    if args.output:
        from profiler.files import write_profiles

        write_profiles(args.output, profiles, f"Roofline estimates (helix profile --estimate) for {shape.name}.\n"
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
    console.print(table)


def _at(curve: list[tuple[float, float]] | None, x: float) -> float:
    """Linear interpolation on a latency curve (nan without one)."""
    if not curve:
        return float("nan")
    import numpy as np

    xs, ys = zip(*sorted(curve), strict=True)
    return float(np.interp(x, xs, ys))


# -- measure -------------------------------------------------------------------------------------


def _run_measure(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from profiler.cluster_profile import profile_cluster

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
                                 measure_links=not args.no_links, notify=notify,
                                 concurrent=args.concurrent)  # fmt: skip
    measured = {g: result.profiles.gpus[g] for g in (*result.measured, *result.cache_hits)}
    print_profiles(console, ProfileSet(models=result.profiles.models, gpus=measured),
                   title=f"{cluster.name}: measured on this machine")  # fmt: skip
    if result.links:
        table = Table(title="links (ZeroMQ: bulk transfer + ping)")
        for col in ("src", "dst", "bandwidth Gbit/s", "latency ms"):
            table.add_column(col, justify="left" if col in ("src", "dst") else "right")
        for m in result.links:
            table.add_row(m.src, m.dst, f"{m.bandwidth_gbps:.2f}", f"{m.latency_ms:.3f}")
        console.print(table)
    cached = f" (cache hits: {', '.join(result.cache_hits)})" if result.cache_hits else ""
    console.print(f"profiles written to [bold]{result.profiles_path}[/]{cached}")
    if result.links_path:
        console.print(f"measured links written to [bold]{result.links_path}[/]")
    if result.skipped_nodes:
        console.print(f"[yellow]not on this machine, not measured:[/] {', '.join(result.skipped_nodes)}")
    console.print(f"done in {result.wall_s:.1f} s")
    return 0
