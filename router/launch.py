"""Start and stop local node agents as subprocesses (``helix agent ...``), leaving none behind.

Used by ``helix demo``, the router tests and the serving bench. Every agent runs in its own
session (process group), with one torch thread, bound to a free loopback port; on Linux it also
gets ``PR_SET_PDEATHSIG`` so it dies with its parent even if the parent is killed with -9.
:meth:`AgentProcesses.stop` sends SIGTERM to each process group, then SIGKILL to stragglers.
Agents print one ``READY node=... control=...`` line once their layers are loaded; the control
address is read from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helix.errors import HelixError

PR_SET_PDEATHSIG = 1


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` used so far (Linux ``/proc``): what an agent or a
    coordinator subprocess costs, for the benches that compare it with a simulation or a baseline."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class AgentProcess:
    node: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    control_address: str | None = None
    _buffer: bytes = b""

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(slots=True)
class AgentProcesses:
    """A set of local agent subprocesses for one cluster + plan."""

    cluster: Path
    plan: Path
    workdir: Path
    secret: str = ""
    model_dir: str | None = None
    extra_args: tuple[str, ...] = ()
    # per node: the host its agent binds (default loopback) and a prefix of its command line, e.g.
    # ``ip netns exec NS`` to run it in an emulated region (helix.netem)
    bind_hosts: dict[str, str] = field(default_factory=dict)
    command_prefix: dict[str, list[str]] = field(default_factory=dict)
    agents: dict[str, AgentProcess] = field(default_factory=dict)

    def start(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self.start_one(node)

    def start_one(self, node: str) -> AgentProcess:
        """Spawn the agent of ``node``; returns before it is READY. A restarted agent binds the
        control address its predecessor had, so the coordinator finds it again."""
        old = self.agents.get(node)
        if old is not None and old.proc.poll() is None:
            raise HelixError(f"agent {node} is already running (pid {old.proc.pid})")
        host = self.bind_hosts.get(node, "127.0.0.1")
        bind = old.control_address if old is not None and old.control_address else f"tcp://{host}:*"
        cmd = [*self.command_prefix.get(node, ()), sys.executable, "-m", "helix.cli", "agent", "--cluster",
               str(self.cluster), "--plan", str(self.plan), "--node", node, "--bind", bind, "--threads", "1", *self.extra_args]
        if self.model_dir:
            cmd += ["--model-dir", self.model_dir]
        env = {**os.environ, "HELIX_SECRET": self.secret, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        log_path = self.workdir / f"agent-{node}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        agent = self.agents[node] = AgentProcess(node, proc, log_path)
        return agent

    def wait_ready(self, timeout_s: float = 180.0, on_ready: Callable[[str], None] | None = None) -> dict[str, str]:
        """Block until every started agent printed READY; returns node -> control address."""
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        pending: dict[Any, AgentProcess] = {a.proc.stdout: a for a in self.agents.values() if a.control_address is None}
        for stream in pending:
            sel.register(stream, selectors.EVENT_READ)
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise HelixError(f"agents {', '.join(a.node for a in pending.values())} not ready after "
                                     f"{timeout_s:.0f} s")
                for key, _ in sel.select(timeout=0.2):
                    agent = pending[key.fileobj]
                    chunk = agent.proc.stdout.read() or b""  # type: ignore[union-attr]
                    agent._buffer += chunk
                    for line in agent._buffer.split(b"\n"):
                        if line.startswith(b"READY "):
                            fields = dict(kv.split("=", 1) for kv in line.decode().split()[1:] if "=" in kv)
                            agent.control_address = fields["control"]
                    if agent.control_address is not None:
                        sel.unregister(key.fileobj)
                        del pending[key.fileobj]
                        if on_ready is not None:
                            on_ready(agent.node)
                for agent in list(pending.values()):
                    if agent.proc.poll() is not None:
                        raise HelixError(f"agent {agent.node} exited with code {agent.proc.returncode} before it was "
                                         f"ready:\n{agent.log_tail()}")
        finally:
            sel.close()
        return self.addresses()

    def addresses(self) -> dict[str, str]:
        return {n: a.control_address for n, a in self.agents.items() if a.control_address}

    def kill(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Signal one agent's process (kill -9 by default) and reap it."""
        agent = self.agents[node]
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.proc.pid, sig)
        agent.proc.wait(timeout=10)

    def pids(self) -> list[int]:
        return [a.proc.pid for a in self.agents.values()]

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every agent's process group, SIGKILL what is left after ``grace_s``."""
        live = [a for a in self.agents.values() if a.proc.poll() is None]
        for a in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(a.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for a in live:
            try:
                a.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait(timeout=5)
        for a in self.agents.values():
            if a.proc.stdout is not None:
                a.proc.stdout.close()

    def __enter__(self) -> AgentProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
