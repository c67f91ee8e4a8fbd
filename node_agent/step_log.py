"""The agent's step log (``helix agent --step-log FILE``): one JSON line per engine step that ran.

Each line: ``t`` (monotonic seconds at the step's start), ``wall_ms``, ``cpu_ms`` (the engine
thread's CPU time: the step's own work, not time the OS gave other processes) and ``by_start``
(``{first layer: [prefill tokens, decoding requests, their context tokens]}``, the composition
the simulator prices an iteration by). ``bench/fidelity.py`` prices every logged step with the
node's profile to tell a profile that is off from a schedule that differs. Lines are buffered
and flushed when the agent stops (a diagnosis aid, not a journal: a killed agent may lose its
tail).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from helix.errors import ConfigError


class _Ran(Protocol):
    outputs: list[Any]
    by_start: dict[int, tuple[int, int, int]]


R = TypeVar("R", bound=_Ran)


class StepLog:
    """Appends step records to ``path`` (created with its directory)."""

    def __init__(self, path: str | Path) -> None:
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = target.open("a", buffering=1 << 16)
        except OSError as exc:
            raise ConfigError(f"cannot write the step log {target}: {exc.strerror or exc}", field="--step-log") from None

    def run(self, step: Callable[[], R]) -> R:
        """Run one engine step, timed; a step that ran something is written down."""
        t0, c0 = time.monotonic(), time.thread_time()
        result = step()
        wall, cpu = time.monotonic() - t0, time.thread_time() - c0
        if result.outputs:
            line = {"t": round(t0, 6), "wall_ms": round(wall * 1000, 4), "cpu_ms": round(cpu * 1000, 4),
                    "by_start": {str(k): list(v) for k, v in sorted(result.by_start.items())}}
            self._file.write(json.dumps(line) + "\n")
        return result

    def close(self) -> None:
        self._file.close()


def read_step_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a step log (``by_start`` keys back to ints, values to tuples)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rec["by_start"] = {int(k): tuple(v) for k, v in rec["by_start"].items()}
            out.append(rec)
    return out
