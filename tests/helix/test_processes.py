"""The supervisor of local processes (helix.processes), on real child processes: ready lines, errors that
name the process and show its log, stop (SIGTERM, then SIGKILL), kill -9, restarts and CPU seconds; the
Python worker process: calls run in it, their errors come back, close leaves none."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from helix.errors import HelixError
from helix.processes import Supervisor, WorkerFailed, WorkerProcess, cpu_seconds


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SERVE = "import os, time; print('READY node=a threads=' + os.environ['OMP_NUM_THREADS'], flush=True); time.sleep(60)"


def test_ready_fields_then_stop_with_sigterm(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as procs:
        procs.start("a", py("import sys; print('loading', file=sys.stderr, flush=True); " + SERVE))
        seen: list[str] = []
        procs.wait_ready(timeout_s=60, on_ready=seen.append)
        a = procs.processes["a"]
        assert seen == ["a"] and a.ready == {"node": "a", "threads": "1"}  # one torch thread
        assert a.running() and "loading" in a.log_text() and a.log_path == tmp_path / "a.log"
        codes = procs.stop()
    assert codes == {"a": -signal.SIGTERM} and not a.running()


def test_a_process_that_exits_first_is_named_with_its_log(tmp_path: Path) -> None:
    with Supervisor(tmp_path, label="agent") as procs:
        procs.start("a", py(SERVE))
        procs.start("b", py("import sys; print('weights not found: /x', file=sys.stderr); sys.exit(5)"))
        with pytest.raises(HelixError) as failed:
            procs.wait_ready(timeout_s=60)
    assert "agent b exited with code 5 before it was ready:\nweights not found: /x" in failed.value.message


def test_not_ready_in_time_names_the_process_and_its_log(tmp_path: Path) -> None:
    with Supervisor(tmp_path, label="link probe") as procs:
        procs.start("p", py("import sys, time; print('binding', file=sys.stderr, flush=True); time.sleep(60)"))
        with pytest.raises(HelixError) as late:
            procs.wait_ready(timeout_s=0.5)
    assert "link probe p not ready after 0.5 s" in late.value.message and "binding" in late.value.message


def test_kill_9_then_start_again_under_the_same_name(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as procs:
        procs.start("a", py(SERVE))
        procs.wait_ready(timeout_s=60)
        with pytest.raises(HelixError, match="agent a is already running"):
            procs.start("a", py(SERVE))
        procs.kill("a")
        assert procs.processes["a"].returncode == -signal.SIGKILL
        procs.start("a", py(SERVE.replace("node=a", "node=again")))
        procs.wait_ready(timeout_s=60)
        assert procs.processes["a"].ready == {"node": "again", "threads": "1"}


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as procs:
        procs.start("stubborn", py("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SERVE))
        procs.wait_ready(timeout_s=60)
        assert procs.stop(grace_s=0.5) == {"stubborn": -signal.SIGKILL}


def test_lines_in_order_then_the_end_and_a_line_on_stdin(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as procs:
        procs.start("a", py("import sys; print('one'); print('got ' + input(), flush=True); sys.stdout.write('two')"),
                    stdin=True)  # fmt: skip
        procs.processes["a"].send_line("go")
        lines: list[str | None] = []
        while None not in lines:
            lines += [line for _, line in procs.read_lines(["a"], timeout_s=60)]
    assert lines == ["one", "got go", "two", None]


def test_cpu_seconds_of_a_busy_process(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as procs:
        busy = procs.start("busy", py("import time\nwhile time.process_time() < 0.3: pass\n" + SERVE))
        procs.wait_ready(timeout_s=60)
        assert cpu_seconds(busy.pid) >= 0.2


def test_a_worker_runs_calls_out_of_this_process_sends_their_errors_back_and_closes() -> None:
    worker = WorkerProcess("test", preload=("json",))
    worker.start()
    pid = worker.pid
    assert pid is not None and worker.call(os.getpid, timeout_s=60) == pid != os.getpid()
    with pytest.raises(ValueError) as failed:
        worker.call(int, "x", timeout_s=60)
    assert f"in the worker process (pid {pid})" in "".join(failed.value.__notes__)
    assert worker.call(sorted, [3, 1, 2], timeout_s=60) == [1, 2, 3] and worker.pid == pid  # the same worker
    worker.close()
    assert worker.pid is None and not psutil.pid_exists(pid)
    with pytest.raises(WorkerFailed, match="closed"):
        worker.call(os.getpid, timeout_s=60)
