"""Measuring every node of one host at the same time, one engine process per node.

:func:`measure_nodes` starts one measuring process per node (``python -m profiler.nodes``, one
torch thread, like ``helix agent``); each reports progress lines and one JSON result on stdout.
Nodes that share a machine (the loopback demo: three agents on two cores) also share its cores
while they serve, so they can be measured *concurrently* (``helix profile --concurrent``): the
processes build their probe stages, print ``LOADED`` and wait for a ``go`` line on stdin, sent
to all once all are loaded, so their timed steps overlap. Steps are timed in thread CPU time
(:func:`profiler.measure.step_clock`), so the time slicing among them is not counted — that is
the simulator's ``host_cores`` — while the contention for caches and memory is. The default
measures one node at a time. Nodes of one GPU type are combined point by point (median) by
:func:`combine`.
"""

from __future__ import annotations

import argparse
import contextlib
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    blob = json.dumps(asdict(settings))
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-m", "profiler.nodes", "--model-dir", model_dir, "--settings", blob,
             *(["--wait-for-go"] if len(nodes) > 1 else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        for node in nodes
    }
    results: dict[str, dict[str, Any]] = {}
    loaded: set[str] = set()
    pending: dict[str, bytes] = dict.fromkeys(procs, b"")  # raw reads: a buffered readline would
    sel = selectors.DefaultSelector()  # hide a second line from select() and stall the barrier
    for node, proc in procs.items():
        assert proc.stdout is not None
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, node)

    def handle(node: str, line: str) -> None:
        if line.startswith(PROGRESS):
            say(node, line[len(PROGRESS):].strip())
        elif line.strip() == LOADED:
            loaded.add(node)
            if len(loaded) == len(procs):  # everyone is ready: start timing together
                say(node, "all co-located nodes loaded: measuring together")
                for p in procs.values():
                    _send_go(p)
        elif line.startswith(RESULT):
            results[node] = json.loads(line[len(RESULT):])

    try:
        open_streams = len(procs)
        while open_streams:
            events = sel.select(timeout=timeout_s)
            if not events:
                raise HelixError(f"profiling processes gave no sign of life for {timeout_s:.0f} s")
            for key, _ in events:
                node = key.data
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    open_streams -= 1
                    if pending[node]:
                        handle(node, pending[node].decode(errors="replace"))
                    if node not in loaded:  # it died before loading: do not keep the others waiting
                        loaded.update(procs)
                        for p in procs.values():
                            _send_go(p)
                    continue
                *lines, pending[node] = (pending[node] + chunk).split(b"\n")
                for line in lines:
                    handle(node, line.decode(errors="replace"))
    finally:
        sel.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
    for node, proc in procs.items():
        if node not in results:
            err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-5:]
            raise HelixError(f"profiling node {node} failed (exit {proc.returncode}): " + " | ".join(err))
        if proc.stderr:
            proc.stderr.close()
    return results


def _send_go(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(GO + "\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # it died: its missing result is reported below


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
    if all("decode_ms_per_context_token" in m for m in measured):
        out["decode_ms_per_context_token"] = round(statistics.median(m["decode_ms_per_context_token"] for m in measured), 7)
    else:
        out.pop("decode_ms_per_context_token", None)
        out.pop("decode_context_tokens", None)
    out.pop("raw", None)
    out["nodes_combined"] = len(measured)
    return out


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
