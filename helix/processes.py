"""The processes Helix starts on this machine, supervised: node agents (:mod:`router.launch`, used by
``helix demo``, the tests and the benches), the profiler's measuring processes and its link probes.

:class:`Supervisor` starts each process by a name (its node, its vertex) with its arguments and
one torch thread, in a session (process group) of its own, stdin closed unless asked for, stdout
on a pipe read line by line and stderr appended to a log file; on Linux it also gets
``PR_SET_PDEATHSIG`` so it dies with its parent even when the parent is killed with -9. A process
is *ready* once it prints one line ``READY key=value ...`` (an agent: ``READY node=a
control=tcp://... data=tcp://...``); the fields are kept. :meth:`Supervisor.wait_ready` fails
with an error naming the process and its log tail when one exits first or time runs out;
:meth:`Supervisor.stop` sends SIGTERM to every process group, SIGKILL to what is left after a
grace period; :meth:`Supervisor.kill` sends one process kill -9 (the failover tests).
:func:`cpu_seconds` is the CPU time a process used (psutil), for the benches.

:class:`WorkerProcess` is a Python worker of this process (a fresh interpreter, started like the
supervised ones: one torch thread, its own session, death with its parent; our ``sys.path``; calls
and results pickled over a socket pair, as ``multiprocessing`` does, without its re-import of our
``__main__``): it runs one call at a time out of our interpreter and sends the result back (the
coordinator's re-planner, so that planning does not take the GIL from token handling). A call that
outlives its deadline gets the worker killed; a worker that dies mid-call (killed, crashed) is
reported as :class:`WorkerFailed`; the next call starts a fresh one. It also ends by itself when its
socket closes (we are gone).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import psutil

from helix.errors import HelixError

T = TypeVar("T")

READY = "READY"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_PR_SET_PDEATHSIG = 1
Line = tuple["ChildProcess", str | None]  # a process and one line it printed; None: it closed its stdout


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` used so far (its children not counted)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class ChildProcess:
    """One supervised process: its name, the running command and its log (its stderr)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, str] | None = None  # the fields of its READY line, once printed
    stdout_open: bool = True
    _partial: bytes = b""  # stdout after the last complete line

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 8) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def send_line(self, text: str) -> None:
        """Write one line to its stdin (started with ``stdin=True``); nothing if it is gone."""
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.write(text.encode() + b"\n")
            self.popen.stdin.flush()

    def _read(self) -> list[Line]:
        """The complete lines its stdout holds now (call when it is readable); a READY line's fields are kept."""
        assert self.popen.stdout is not None
        chunk = os.read(self.popen.stdout.fileno(), 1 << 16)
        if not chunk:
            self.stdout_open = False
            lines, self._partial = [self._partial] if self._partial else [], b""
        else:
            *lines, self._partial = (self._partial + chunk).split(b"\n")
        out: list[Line] = []
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            if line.split(" ", 1)[0] == READY:
                self.ready = {key: value for key, sep, value in (kv.partition("=") for kv in line.split()[1:]) if sep}
            out.append((self, line))
        return out + ([(self, None)] if not chunk else [])

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def _close(self) -> None:
        self.stdout_open = False
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class Supervisor:
    """The processes started here, by name; a context manager that stops them all on exit. ``label``
    says what they are in errors (``agent cpu-1 exited with code 1 before it was ready``)."""

    def __init__(self, workdir: Path, *, label: str = "agent") -> None:
        self.workdir = Path(workdir)
        self.label = label
        self.processes: dict[str, ChildProcess] = {}

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: bool = False,
              log_path: Path | None = None) -> ChildProcess:  # fmt: skip
        """Spawn ``argv`` as process ``name`` (our environment, one torch thread, then ``env``); returns at once,
        before it is ready. Its stderr is appended to ``log_path`` (default ``WORKDIR/NAME.log``). A name may be
        started again once its process has exited (an agent restarted after a kill)."""
        old = self.processes.get(name)
        if old is not None and old.running():
            raise HelixError(f"{self.label} {name} is already running (pid {old.pid})")
        log_path = log_path or self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=log,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     env={**os.environ, **ONE_THREAD, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent)  # fmt: skip
        if old is not None:
            old._close()
        process = self.processes[name] = ChildProcess(name, popen, log_path)
        return process

    def read_lines(self, names: Iterable[str], timeout_s: float) -> list[Line]:
        """The complete lines the named processes printed, waiting up to ``timeout_s`` for the first;
        ``(process, None)`` once a process closed its stdout (it exited). Empty when the time ran out."""
        watched = [p for p in (self.processes[n] for n in names) if p.stdout_open]
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for process in watched:
                assert process.popen.stdout is not None
                selector.register(process.popen.stdout, selectors.EVENT_READ, process)
            while True:
                out: list[Line] = []
                for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    out += key.data._read()
                    if not key.data.stdout_open:
                        selector.unregister(key.fileobj)
                if out or time.monotonic() >= deadline:
                    return out

    def wait_ready(self, names: Iterable[str] | None = None, *, timeout_s: float = 180.0,
                   on_ready: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """Block until every named process (default: every one not ready yet) printed its READY line,
        calling ``on_ready(name)`` for each; HelixError with the log tail of a process that exited
        first or of those still not ready after ``timeout_s``."""
        pending = {n for n in (self.processes if names is None else names) if self.processes[n].ready is None}
        deadline = time.monotonic() + timeout_s
        while pending:
            for process, _ in self.read_lines(pending, timeout_s=min(0.2, max(0.0, deadline - time.monotonic()))):
                if process.ready is not None and process.name in pending:
                    pending.discard(process.name)
                    if on_ready is not None:
                        on_ready(process.name)
            for name in sorted(pending):
                process = self.processes[name]
                if not process.running():
                    raise HelixError(f"{self.label} {name} exited with code {process.returncode} before it was "
                                     f"ready:\n{process.log_tail()}")  # fmt: skip
            if pending and time.monotonic() >= deadline:
                tails = "".join(f"\n{self.label} {n}:\n{self.processes[n].log_tail()}" for n in sorted(pending))
                raise HelixError(f"{self.label} {', '.join(sorted(pending))} not ready after {timeout_s:g} s{tails}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send process ``name`` ``sig`` (kill -9 by default: an agent lost mid-stream) and reap it."""
        process = self.processes[name]
        process.popen.send_signal(sig)
        process.popen.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> dict[str, int | None]:
        """SIGTERM every running process's group, SIGKILL what is left after ``grace_s``; name -> exit code."""
        live = [p for p in self.processes.values() if p.running()]
        for process in live:
            process._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in live:
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process._signal_group(signal.SIGKILL)
                process.popen.wait(timeout=5)
        for process in self.processes.values():
            process._close()
        return {name: p.returncode for name, p in self.processes.items()}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class WorkerFailed(HelixError):
    """A worker process died during a call, or did not answer in time (and was killed)."""


class WorkerProcess:
    """A Python worker process that runs calls out of this interpreter, one at a time (see the module
    doc). ``name`` says what it is in errors; ``preload``: modules it imports as it starts."""

    def __init__(self, name: str, *, preload: Sequence[str] = ()) -> None:
        self.name, self.preload = name, tuple(preload)
        self._popen: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one call at a time; held for the whole round trip
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The running worker's pid (None before the first start and after a death or close)."""
        popen = self._popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def start(self) -> None:
        """Start the worker now rather than at the first call (it imports ``preload`` meanwhile)."""
        with self._lock:
            self._ensure()

    def call(self, fn: Callable[..., T], *args: object, timeout_s: float) -> T:
        """``fn(*args)`` in the worker (``fn`` importable by name; arguments and result picklable), blocking
        until it answers. Raises what ``fn`` raised (its traceback in the worker is in the exception's
        notes), or :class:`WorkerFailed` when the worker dies meanwhile or does not answer within
        ``timeout_s`` (it is killed then); the next call starts a fresh worker."""
        with self._lock:
            conn = self._ensure()
            pid = self._popen.pid if self._popen is not None else None
            try:
                conn.send((fn, args))
                answered = conn.poll(timeout_s)  # True at EOF too: recv tells
                if answered:
                    ok, value = conn.recv()
            except (EOFError, OSError):
                raise self._died(pid) from None
            if not answered:
                self._stop_process()
                raise WorkerFailed(f"the {self.name} worker (pid {pid}) did not answer within {timeout_s:g} s; "
                                   f"it was killed")  # fmt: skip
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def close(self) -> None:
        """Stop the worker (kill -9: its only state is the call in flight, which then fails with
        WorkerFailed) and reap it; calls after this fail."""
        self._closed = True
        popen = self._popen
        if popen is not None:
            with contextlib.suppress(OSError):
                popen.kill()
        with self._lock:
            self._stop_process()

    # -- the lock held -----------------------------------------------------------------------------

    def _ensure(self) -> Connection:
        if self._closed:
            raise WorkerFailed(f"the {self.name} worker is closed")
        if self._popen is not None and self._conn is not None and self._popen.poll() is None:
            return self._conn
        self._stop_process()
        ours, theirs = socket.socketpair()  # as multiprocessing.Pipe(): pickles over a Unix socket
        with ours, theirs:
            self._popen = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno()), *self.preload],
                                           pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                           env={**os.environ, **ONE_THREAD}, start_new_session=True,
                                           preexec_fn=_die_with_parent)  # fmt: skip
            self._conn = Connection(ours.detach())
        self._conn.send(list(sys.path))  # the worker imports what we can
        return self._conn

    def _died(self, pid: int | None) -> WorkerFailed:
        code = None
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._popen.wait(timeout=5)
        how = "its exit code unknown" if code is None else f"killed by signal {-code}" if code < 0 else \
            f"exit code {code}"
        self._stop_process()
        return WorkerFailed(f"the {self.name} worker (pid {pid}) died during a call ({how})")

    def _stop_process(self) -> None:
        popen, conn = self._popen, self._conn
        self._popen = self._conn = None
        if conn is not None:
            conn.close()
        if popen is not None:
            with contextlib.suppress(OSError):
                popen.kill()
            popen.wait(timeout=10)


# The worker's command line (python -c): no re-import of our __main__ (multiprocessing's spawn would)
_WORKER_MAIN = ("import sys; from multiprocessing.connection import Connection; conn = Connection(int(sys.argv[1])); "
                "sys.path[:] = conn.recv(); from helix.processes import _serve_calls; _serve_calls(conn, sys.argv[2:])")


def _serve_calls(conn: Connection, preload: Sequence[str]) -> None:
    """The worker's main: import ``preload``, then answer calls until the pipe closes."""
    for module in preload:
        importlib.import_module(module)
    while True:
        reply: tuple[bool, object]
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe, or died
        except Exception as exc:  # the call does not unpickle here (its function is not importable)
            fn, args = _reraise, (exc,)
        try:
            reply = (True, fn(*args))
        except Exception as exc:
            reply = (False, _portable(exc, f"in the worker process (pid {os.getpid()}):\n{traceback.format_exc()}"))
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionError, EOFError):
            return
        except Exception as exc:  # the result does not pickle
            conn.send((False, RuntimeError(f"the worker cannot send its result back: {type(exc).__name__}: {exc}")))


def _reraise(exc: Exception) -> None:
    raise exc


def _portable(exc: Exception, note: str) -> Exception:
    """``exc`` with ``note`` if it survives pickling (the parent re-raises it), else a RuntimeError naming it."""
    exc.add_note(note)
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        plain = RuntimeError(f"{type(exc).__name__}: {exc}")
        plain.add_note(note)
        return plain
    return exc
