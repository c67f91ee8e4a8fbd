"""The node agents of one cluster + plan as local processes (``helix agent ...``), leaving none behind.

Used by ``helix demo``, the tests and the benches. The processes themselves (own session, one
torch thread, death with the parent, the READY line, stop and kill) are a
:class:`helix.processes.Supervisor`'s; :class:`AgentProcesses` knows an agent's command line: its
node, the plan, ``--threads 1`` and a free port on its host, or, for an agent started again after
it died, the control address its predecessor had, so the coordinator finds it again. The control
address comes from the agent's ``READY node=... control=... data=...`` line.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from helix.addresses import LOOPBACK
from helix.processes import ChildProcess, Supervisor


@dataclass(slots=True)
class AgentProcesses:
    """A set of local agent processes for one cluster + plan, by node; logs in ``workdir/agent-NODE.log``."""

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
    supervisor: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.workdir, label="agent")

    @property
    def agents(self) -> dict[str, ChildProcess]:
        return self.supervisor.processes

    def start(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self.start_one(node)

    def start_one(self, node: str, extra_args: Sequence[str] = ()) -> ChildProcess:
        """Spawn the agent of ``node`` (``extra_args`` after the common ones); returns before it is READY."""
        return self._start(node, ["--plan", str(self.plan), *extra_args])

    def start_joining(self, node: str, coordinator_url: str, gpu: str, *, api_key: str = "",
                      extra_args: Sequence[str] = ()) -> ChildProcess:  # fmt: skip
        """Spawn the agent of a node joining the running cluster of ``coordinator_url`` (``helix agent
        --join``: no plan, no layers until the coordinator's re-plan gives it some)."""
        return self._start(node, ["--join", coordinator_url, "--gpu", gpu, *extra_args], {"HELIX_API_KEY": api_key})

    def _start(self, node: str, args: Sequence[str], env: dict[str, str] | None = None) -> ChildProcess:
        old = self.agents.get(node)
        control = old.ready.get("control") if old is not None and old.ready else None
        bind = control or f"tcp://{self.bind_hosts.get(node, LOOPBACK)}:*"
        cmd = [*self.command_prefix.get(node, ()), sys.executable, "-m", "helix.cli", "agent", "--cluster",
               str(self.cluster), "--node", node, "--bind", bind, "--threads", "1", *self.extra_args, *args]  # fmt: skip
        if self.model_dir:
            cmd += ["--model-dir", self.model_dir]
        return self.supervisor.start(node, cmd, env={"HELIX_SECRET": self.secret, **(env or {})},
                                     log_path=self.workdir / f"agent-{node}.log")  # fmt: skip

    def wait_ready(self, timeout_s: float = 180.0, on_ready: Callable[[str], None] | None = None) -> dict[str, str]:
        """Block until every started agent printed READY; returns node -> control address."""
        self.supervisor.wait_ready(timeout_s=timeout_s, on_ready=on_ready)
        return self.addresses()

    def addresses(self) -> dict[str, str]:
        """Node -> the control address of its agent (every agent that was ready once)."""
        return {n: a.ready["control"] for n, a in self.agents.items() if a.ready and "control" in a.ready}

    def pids(self) -> list[int]:
        return [a.pid for a in self.agents.values()]

    def kill(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Signal one agent's process (kill -9 by default) and reap it."""
        self.supervisor.kill(node, sig)

    def stop(self, grace_s: float = 5.0) -> dict[str, int | None]:
        """SIGTERM every agent, SIGKILL what is left after ``grace_s``; node -> exit code."""
        return self.supervisor.stop(grace_s)

    def __enter__(self) -> AgentProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
