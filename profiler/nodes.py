"""Measuring every node of one host at the same time, one engine process per node.

:func:`measure_nodes` starts one measuring process per node (``python -m profiler.nodes``, one
torch thread, supervised as agents are: :mod:`helix.processes`); each reports progress lines and one
JSON result on stdout, its errors in its log.
Nodes that share a machine (the loopback demo: three agents on two cores) also share its cores
while they serve, so they can be measured *concurrently* (``helix profile --concurrent``): the
processes build their probe stages, print ``LOADED`` and wait for a ``go`` line on stdin, sent
to all once all are loaded, so their timed steps overlap. Steps are timed in thread CPU time
(:func:`profiler.device.step_clock`), so the time slicing among them is not counted — that is
the simulator's ``host_cores`` — while the contention for caches and memory is. The default
measures one node at a time. Nodes of one GPU type are combined point by point (median) by
:func:`combine`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from helix.errors import HelixError
from helix.processes import Supervisor
from profiler.measure import MeasureSettings, measure_device
from profiler.step_costs import with_step_costs

PROGRESS = "PROGRESS "
RESULT = "RESULT "
LOADED = "LOADED"  # a measuring process built its stages; it starts timing on a "go" line on stdin
GO = "go"


def measure_nodes(
    model_dir: str, nodes: list[str], settings: MeasureSettings, *, notify: Callable[[str, str], None] | None = None,
    timeout_s: float = 600.0, concurrent: bool = True,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Measure ``nodes`` (one process each, all at once unless ``concurrent`` is False);
    node -> measure_device's result."""
    if not concurrent:
        out: dict[str, dict[str, Any]] = {}
        for node in nodes:
            out |= measure_nodes(model_dir, [node], settings, notify=notify, timeout_s=timeout_s)
        return out
    say = notify or (lambda _node, _msg: None)
    argv = [sys.executable, "-m", "profiler.nodes", "--model-dir", model_dir, "--settings", json.dumps(asdict(settings)),
            *(["--wait-for-go"] if len(nodes) > 1 else [])]  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    waiting: set[str] | None = set(nodes) if len(nodes) > 1 else None  # not loaded yet: the others wait for them
    with tempfile.TemporaryDirectory(prefix="helix-profile-") as logs:
        with Supervisor(Path(logs), label="profiling node") as procs:
            for node in nodes:
                procs.start(node, argv, stdin=True)
            talking = set(nodes)
            while talking:
                lines = procs.read_lines(talking, timeout_s)
                if not lines:
                    raise HelixError(f"profiling processes gave no sign of life for {timeout_s:.0f} s")
                for process, line in lines:
                    if line is None:  # it exited
                        talking.discard(process.name)
                    elif line.startswith(PROGRESS):
                        say(process.name, line[len(PROGRESS):].strip())
                    elif line.startswith(RESULT):
                        results[process.name] = json.loads(line[len(RESULT):])
                    if waiting is not None and (line is None or line.strip() == LOADED):
                        waiting.discard(process.name)  # loaded, or gone before: none waits for it
                        if not waiting:  # start timing together
                            say(process.name, "all co-located nodes loaded: measuring together")
                            for other in procs.processes.values():
                                other.send_line(GO)
                            waiting = None
        for node, process in procs.processes.items():
            if node not in results:
                raise HelixError(f"profiling node {node} failed (exit {process.returncode}): "
                                 + " | ".join(process.log_tail(5).splitlines()))  # fmt: skip
    return results


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def combine(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Nodes of one GPU type as one profile: the point-by-point median of their curves, made
    non-decreasing (on a shared machine noise can make a bigger batch look cheaper)."""
    measured = [with_step_costs(m) for m in measured]  # older cached results: split the fixed costs out
    out = dict(measured[0])
    curves = ["prefill_ms_per_layer", "decode_ms_per_layer"]
    if all("step_overhead_ms" in m and "head_ms" in m for m in measured):
        curves += ["step_overhead_ms", "head_ms"]
    else:
        out.pop("step_overhead_ms", None)
        out.pop("head_ms", None)
    for curve in curves:
        out[curve] = _median_curve([m[curve] for m in measured], 4)
    pets = [m.get("pet_ms_per_layer") or {} for m in measured]
    out.pop("pet_ms_per_layer", None)
    if pet_types := [t for t in pets[0] if all(t in p for p in pets)]:  # the types every node measured
        out["pet_ms_per_layer"] = {t: _median_curve([p[t] for p in pets], 6) for t in pet_types}
    if all("decode_ms_per_context_token" in m for m in measured):
        out["decode_ms_per_context_token"] = round(statistics.median(m["decode_ms_per_context_token"] for m in measured), 7)
    else:
        out.pop("decode_ms_per_context_token", None)
        out.pop("decode_context_tokens", None)
    out.pop("raw", None)
    out["nodes_combined"] = len(measured)
    return out


def _median_curve(curves: list[list[list[float]]], digits: int) -> list[list[float]]:
    """One curve from several nodes' of the same points: the point-by-point median, made non-decreasing."""
    xs = [p[0] for p in curves[0]]
    ys = [statistics.median(p[1] for p in points) for points in zip(*curves, strict=True)]
    return [[x, round(y, digits)] for x, y in zip(xs, non_decreasing(ys), strict=True)]


def main(argv: list[str] | None = None) -> int:
    """The measuring process: one engine, progress and the JSON result on stdout."""
    ap = argparse.ArgumentParser(description="Measure this machine's engine (started by `helix profile`).")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--settings", default="{}", help="MeasureSettings as JSON")
    ap.add_argument("--wait-for-go", action="store_true",
                    help=f"print {LOADED} once the stages are built, then wait for a '{GO}' line on stdin")
    args = ap.parse_args(argv)

    def loaded() -> None:
        if args.wait_for_go:
            print(LOADED, flush=True)
            sys.stdin.readline()  # "go", or EOF if the parent is gone: measure anyway
    raw = json.loads(args.settings)
    settings = MeasureSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})  # type: ignore[arg-type]
    try:
        result = measure_device(args.model_dir, settings, progress=lambda m: print(PROGRESS + m, flush=True),
                                loaded=loaded)
    except HelixError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
