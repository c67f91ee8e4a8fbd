"""``helix init``: a commented starter cluster file for the GPUs a user names.

``helix init --gpus A100-80GB:2@us-east,L4:4@eu-west --model llama-2-70b -o my-cluster.yaml``
writes ``my-cluster.yaml`` (nodes, coordinator, link defaults, a comment on every field worth
editing) and, beside it, ``my-cluster-profiles.yaml`` with roofline estimates of those GPUs
(:mod:`profiler.roofline`, the same as ``helix profile --estimate``); ``--profiles PATH`` uses an
existing profiles file instead. ``helix plan`` accepts the result as it is. Before anything is
written the cluster is validated against its profiles; a cluster whose nodes cannot hold the
model together is still written, with a warning saying what limits each node and what to change.
Existing files are never overwritten without ``--force``.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from helix.errors import ConfigError, InfeasiblePlanError
from helix.loading import validate
from helix.profile import ProfileSet, check_profiles, load_profile_file
from helix.spec import ClusterSpec
from profiler.kv_reserve import KvReserve

DEFAULT_INTRA_REGION = {"bandwidth_gbps": 10, "latency_ms": 1}  # a datacenter network
DEFAULT_INTER_REGION = {"bandwidth_gbps": 1, "latency_ms": 50}  # a WAN between regions


@dataclass(frozen=True, slots=True)
class GpuGroup:
    """``A100-80GB:2@us-east``: ``count`` GPUs of one type in one region (or none)."""

    gpu: str
    count: int
    region: str | None


def parse_gpus(text: str) -> list[GpuGroup]:
    """``GPU[:COUNT][@REGION],...`` -> groups (COUNT 1 when absent)."""
    groups = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        match = re.fullmatch(r"([^:@\s]+)(?::(\d+))?(?:@([^:@\s]+))?", item)
        if match is None:
            raise ConfigError(f"{item!r} is not GPU[:COUNT][@REGION] (e.g. A100-80GB:2@us-east)", field="--gpus")
        gpu, count, region = match.group(1), int(match.group(2) or 1), match.group(3)
        if count < 1:
            raise ConfigError(f"{item!r}: the count must be 1 or more", field="--gpus")
        groups.append(GpuGroup(gpu, count, region))
    if not groups:
        raise ConfigError("name at least one GPU, e.g. --gpus A100-80GB:2,L4:4", field="--gpus")
    return groups


def add_init_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", required=True, metavar="GPU[:N][@REGION],...",
                   help="the GPUs: type, how many (default 1) and optionally their region, "
                        "e.g. A100-80GB:2@us-east,L4:4@eu-west (types: helix profile --estimate's, or --profiles')")
    p.add_argument("--model", required=True, metavar="NAME",
                   help="the model to serve: a built-in model of helix profile --estimate (e.g. llama-2-70b), "
                        "or one of the --profiles file")
    p.add_argument("-o", "--output", default="cluster.yaml", metavar="CLUSTER", help="the cluster file to write")
    p.add_argument("--name", help="the cluster's name (default: the output file's name without .yaml)")
    p.add_argument("--profiles", metavar="PATH",
                   help="use this existing profiles file (e.g. one of clusters/) instead of writing roofline "
                        "estimates to CLUSTER-profiles.yaml beside the cluster")
    p.add_argument("--force", action="store_true", help="overwrite the files if they exist")
    kv = p.add_argument_group("KV reserve of the estimates (what decides max_layers; as helix profile --estimate)")
    from profiler.commands import add_kv_reserve_arguments

    add_kv_reserve_arguments(kv)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "node"


def _scalar(value: str) -> str:
    """One YAML scalar, quoted where YAML needs it."""
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 16).strip()[1:-1]


def _flow(mapping: dict) -> str:
    """One YAML flow mapping (``{id: a, gpu: L4}``), quoted where YAML needs it."""
    return yaml.safe_dump(mapping, default_flow_style=True, sort_keys=False, width=1 << 16).strip()


def cluster_text(groups: list[GpuGroup], *, name: str, model: str, profiles: str, profiles_note: str) -> str:
    """The starter cluster file, comments included."""
    regions = list(dict.fromkeys(g.region for g in groups if g.region))
    nodes: list[dict[str, str]] = []
    counters: dict[str, int] = {}
    for group in groups:
        for _ in range(group.count):
            slug = _slug(group.gpu)
            index = counters.get(slug, 0)
            counters[slug] = index + 1
            node = {"id": f"{slug}-{index}", "gpu": group.gpu}
            if group.region:
                node["region"] = group.region
            nodes.append(node)
    summary = ", ".join(f"{g.count} x {g.gpu}" + (f" in {g.region}" if g.region else "") for g in groups)
    lines = [
        f"# {name}: a starter cluster written by `helix init` for {summary}, serving {model}.",
        "# Every field, its unit and its default: docs/config.md. Check the lines marked EDIT, then",
        "#   helix plan THIS_FILE -o plan.json",
        f"name: {_scalar(name)}",
        f"model: {_scalar(model)}   # a key of `models` in the profiles",
        f"profiles: {_scalar(profiles)}   # {profiles_note}",
        "coordinator:                 # the HTTP endpoint: sends token ids to the first stage, gets tokens back",
        "  id: coordinator",
    ]
    if regions:
        lines.append(f"  region: {regions[0]}    # EDIT: where the coordinator runs (links to it follow `defaults`)")
    lines += [
        "  # nic_gbps: 10             # optional: its NIC in Gbit/s caps the total traffic each way",
        "nodes:                       # one per GPU; `gpu` is a key of `gpus` in the profiles",
        *(f"  - {_flow(node)}" for node in nodes),
        "  # per node, optional: address: \"tcp://HOST:PORT\" where its agent listens (needed on other",
        "  # machines; absent: a loopback port), max_layers: N to hold fewer layers than its profile allows",
        "links: []                    # explicit links win over `defaults`, e.g.",
        f"  # - {{src: {nodes[0]['id']}, dst: {nodes[-1]['id']}, bandwidth_gbps: 5, latency_ms: 20, bidirectional: true}}",
        "defaults:                    # links for every pair not in `links`; bandwidth_gbps is 10^9 bits/s",
        f"  intra_region: {_flow(DEFAULT_INTRA_REGION)}   # EDIT: your network inside one region",
    ]
    inter = f"inter_region: {_flow(DEFAULT_INTER_REGION)}   # EDIT: your network between regions"
    lines.append(f"  {inter}" if len(regions) > 1 else f"  # {inter}")
    return "\n".join(lines) + "\n"


def _estimate(groups: list[GpuGroup], model: str, reserve: KvReserve) -> tuple[ProfileSet, dict[str, str], str]:
    """Roofline profiles keyed by the canonical GPU names, the user's spelling -> that name, and
    the model's canonical name."""
    from profiler.gpus import BUILTIN_MODELS, gpu_spec
    from profiler.roofline import Roofline, estimate_profiles

    shape = BUILTIN_MODELS.get(model.lower())
    if shape is None:
        raise ConfigError(f"unknown model {model!r} (built-in: {', '.join(BUILTIN_MODELS)}); for another model "
                          "write its profiles with helix profile --estimate --model-config PATH --gpus ... -o FILE "
                          "and give helix init --profiles FILE", field="--model")  # fmt: skip
    specs = {g.gpu: gpu_spec(g.gpu) for g in groups}
    canonical = {g: spec.name for g, spec in specs.items()}
    profiles = estimate_profiles({spec.name: spec for spec in specs.values()}, shape, Roofline(kv_reserve=reserve))
    return profiles, canonical, shape.name


def run_init(args: argparse.Namespace) -> int:
    from profiler.commands import kv_reserve_from

    console = Console(highlight=False)
    out = Path(args.output)
    groups = parse_gpus(args.gpus)
    reserve = kv_reserve_from(args, KvReserve())
    name, model = args.name or out.stem, args.model
    if args.profiles:
        profiles_path = Path(args.profiles)
        profiles = load_profile_file(profiles_path)
        profiles_ref = os.path.relpath(profiles_path.resolve(), out.resolve().parent)
        note = "the profiles given to helix init"
        write_profiles_to = None
    else:
        profiles, canonical, model = _estimate(groups, model, reserve)
        groups = [GpuGroup(canonical[g.gpu], g.count, g.region) for g in groups]
        write_profiles_to = out.with_name(f"{out.stem}-profiles.yaml")
        profiles_ref = write_profiles_to.name
        note = "roofline estimates (helix init); measure them: helix profile --cluster THIS_FILE"
    for path in (out, write_profiles_to):
        if path is not None and path.exists() and not args.force:
            raise ConfigError("exists; give --force to overwrite it", source=str(path))
    text = cluster_text(groups, name=name, model=model, profiles=profiles_ref, profiles_note=note)
    cluster = validate(ClusterSpec, yaml.safe_load(text), str(out))
    cluster._source = str(out)
    cluster.check_connectivity()
    problem: InfeasiblePlanError | None = None
    try:
        check_profiles(cluster, profiles)
    except InfeasiblePlanError as exc:
        problem = exc
    out.parent.mkdir(parents=True, exist_ok=True)
    if write_profiles_to is not None:
        from profiler.files import write_profiles

        write_profiles(write_profiles_to, profiles, f"Roofline estimates (helix init) for {model}; max_layers "
                       f"keeps the {reserve.describe()}.\nSee docs/profiler.md; latency curves are per ONE layer.")  # fmt: skip
        console.print(f"wrote [bold]{escape(str(write_profiles_to))}[/] (roofline estimates, {reserve.describe()})",
                      soft_wrap=True)
    out.write_text(text)
    console.print(f"wrote [bold]{escape(str(out))}[/]: {len(cluster.nodes)} nodes serving {escape(model)}", soft_wrap=True)
    for gpu in dict.fromkeys(n.gpu for n in cluster.nodes):
        tp = profiles.throughput(gpu, model)
        console.print(f"  {escape(gpu)}: at most {tp.max_layers} layers each")
    if problem is not None:
        console.print(f"[bold yellow]warning:[/] helix plan will refuse it as it is: {escape(problem.message)}\n"
                      "helix init takes the same --kv-requests / --kv-context-tokens / --kv-reserve-gb")  # fmt: skip
    else:
        console.print(f"next: edit the lines marked EDIT, then [bold]helix plan {escape(str(out))}[/]")
    return 0
