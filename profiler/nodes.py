"""Measuring every node of one host at the same time, one engine process per node.

:func:`measure_nodes` starts one measuring process per node (``python -m profiler.nodes``, one
torch thread, like ``helix agent``); each reports progress lines and one JSON result on stdout.
Nodes that share a machine (the loopback demo: three agents on two cores) also share its cores
while they serve, so they can be measured *concurrently* (``helix profile --concurrent``); a
saturating benchmark overstates that contention (serving agents wait on the network between
steps), so the default measures one node at a time. Nodes of one GPU type are combined point by
point (median) by :func:`combine`.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from helix.errors import HelixError
from profiler.measure import MeasureSettings, measure_device, with_step_costs

PROGRESS = "PROGRESS "
RESULT = "RESULT "


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    blob = json.dumps(asdict(settings))
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-m", "profiler.nodes", "--model-dir", model_dir, "--settings", blob],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        for node in nodes
    }
    results: dict[str, dict[str, Any]] = {}
    sel = selectors.DefaultSelector()
    for node, proc in procs.items():
        assert proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ, node)
    try:
        open_streams = len(procs)
        while open_streams:
            events = sel.select(timeout=timeout_s)
            if not events:
                raise HelixError(f"profiling processes gave no sign of life for {timeout_s:.0f} s")
            for key, _ in events:
                node = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                elif line.startswith(PROGRESS):
                    say(node, line[len(PROGRESS):].strip())
                elif line.startswith(RESULT):
                    results[node] = json.loads(line[len(RESULT):])
    finally:
        sel.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for node, proc in procs.items():
        if node not in results:
            err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-5:]
            raise HelixError(f"profiling node {node} failed (exit {proc.returncode}): " + " | ".join(err))
        if proc.stderr:
            proc.stderr.close()
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
        xs = [p[0] for p in measured[0][curve]]
        ys = [statistics.median(p[1] for p in points) for points in zip(*(m[curve] for m in measured), strict=True)]
        out[curve] = [[x, round(y, 4)] for x, y in zip(xs, non_decreasing(ys), strict=True)]
    out.pop("raw", None)
    out["nodes_combined"] = len(measured)
    return out


def main(argv: list[str] | None = None) -> int:
    """The measuring process: one engine, progress and the JSON result on stdout."""
    ap = argparse.ArgumentParser(description="Measure this machine's engine (started by `helix profile`).")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--settings", default="{}", help="MeasureSettings as JSON")
    args = ap.parse_args(argv)
    raw = json.loads(args.settings)
    settings = MeasureSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})  # type: ignore[arg-type]
    try:
        result = measure_device(args.model_dir, settings, progress=lambda m: print(PROGRESS + m, flush=True))
    except HelixError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
