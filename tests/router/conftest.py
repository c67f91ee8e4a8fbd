"""A real serving cluster shared by the HTTP and failover tests (started once, only if used).

Three ``helix agent`` subprocesses serve SmolLM2-135M on loopback with the test placement
``cpu-0: [0, 30)``, ``cpu-1: [0, 16)``, ``cpu-2: [16, 30)`` - pipelines ``cpu-0`` alone or
``cpu-1 -> cpu-2`` / ``cpu-1 -> cpu-0`` (a partial hand-off), so losing any one agent leaves a
complete pipeline. The coordinator runs in this process under uvicorn on a background thread,
with API key ``test-key``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO_CLUSTER = REPO / "clusters" / "demo" / "cluster.yaml"
TEST_PLACEMENT = {"cpu-0": (0, 30), "cpu-1": (0, 16), "cpu-2": (16, 30)}
API_KEY = "test-key"
MODEL = "smollm2-135m"


def free_loopback_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 right now (bound and released together)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture(scope="session")
def demo_cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``clusters/demo`` copied with every address on a free loopback port, so these tests do not
    collide with a running ``make demo`` or a second test run on the same machine."""
    import shutil

    import yaml

    root = tmp_path_factory.mktemp("demo-cluster") / "demo"
    shutil.copytree(DEMO_CLUSTER.parent, root, ignore=shutil.ignore_patterns(".helix-profile-cache"))
    raw = yaml.safe_load((root / "cluster.yaml").read_text())
    vertices = [raw["coordinator"], *raw["nodes"]]
    for vertex, port in zip(vertices, free_loopback_ports(len(vertices)), strict=True):
        vertex["address"] = f"tcp://127.0.0.1:{port}"
    (root / "cluster.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root / "cluster.yaml"


@dataclass
class ServingCluster:
    base_url: str
    coordinator: Any
    agents: Any
    server: Any

    def client(self, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", API_KEY), max_retries=0,
                      timeout=kw.pop("timeout", 120), **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()


def make_test_plan(path: Path, placement: dict[str, tuple[int, int]] = TEST_PLACEMENT) -> Path:
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import finish_plan

    cluster = load_cluster(DEMO_CLUSTER)
    plan = finish_plan(cluster, load_profiles_for(cluster), placement, method="manual")
    plan.save(path)
    return path


@pytest.fixture(scope="session")
def serving_cluster(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path) -> Iterator[ServingCluster]:
    yield from serve_cluster(tmp_path_factory, demo_cluster)


@pytest.fixture(scope="session")
def vllm_serving_cluster(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path) -> Iterator[ServingCluster]:
    """The same cluster with every node on the vLLM backend (set in the cluster file)."""
    import yaml

    raw = yaml.safe_load(demo_cluster.read_text())
    for node in raw["nodes"]:
        node["backend"] = "vllm"
    vllm_cluster = demo_cluster.with_name("cluster-vllm.yaml")
    vllm_cluster.write_text(yaml.safe_dump(raw, sort_keys=False))
    yield from serve_cluster(tmp_path_factory, vllm_cluster)


@pytest.fixture(scope="session")
def cluster_server() -> Callable[..., Iterator[ServingCluster]]:
    """:func:`serve_cluster`, for a test module that serves a cluster file of its own."""
    return serve_cluster


def serve_cluster(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path,
                  agent_args: Sequence[str] = (), *, options: Any = None,
                  placement: dict[str, tuple[int, int]] = TEST_PLACEMENT) -> Iterator[ServingCluster]:  # fmt: skip
    """Agents of ``placement`` (default the test placement) for ``demo_cluster``'s nodes (``agent_args``
    added to each agent's command line, e.g. ``--chunk-size 16``) and a coordinator serving them
    (``options``: its ``router.serving.ServeOptions``, default a fixed plan and ``max_tokens_cap=4096``)."""
    from helix.plan import load_plan
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from router.launch import AgentProcesses
    from router.serving import ServeOptions, build_coordinator, create_server_app, make_server

    workdir = tmp_path_factory.mktemp("serving")
    plan_path = make_test_plan(workdir / "plan.json", placement)
    secret = "test-secret"
    agents = AgentProcesses(demo_cluster, plan_path, workdir, secret=secret, extra_args=tuple(agent_args))
    server: Any = None
    thread: threading.Thread | None = None
    try:
        agents.start(placement)
        addresses = agents.wait_ready(timeout_s=240)
        cluster = load_cluster(demo_cluster)
        coordinator = build_coordinator(cluster, load_plan(plan_path), load_profiles_for(cluster),
                                        options or ServeOptions(max_tokens_cap=4096))
        app = create_server_app(coordinator, addresses, secret=secret.encode(), api_keys=[API_KEY])
        server = make_server(app, "127.0.0.1", 0)
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not (server.started and coordinator.ready):
            assert time.monotonic() < deadline, "coordinator did not become ready"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield ServingCluster(f"http://127.0.0.1:{port}", coordinator, agents, server)
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
        agents.stop()
