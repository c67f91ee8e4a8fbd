"""Two agents in separate network namespaces behind a shaped, delayed link (helix.netem): the
greedy answer is the one the same two agents give on loopback, and the activations really crossed
the shaped link.

Region ``a`` holds the coordinator and ``cpu-1`` (layers [0, 16)), region ``b`` holds ``cpu-2``
([16, 30)); a -> b and b -> a are 20 Mbit/s with 10 ms one way (htb in the kernel; the latency by
netem where the kernel has it, else by helix.netem's delay line). Needs root, as CI has.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from helix.netem import NS_PREFIX, LinkShape, Wan

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "clusters" / "demo"
PLACEMENT = {"cpu-1": (0, 16), "cpu-2": (16, 30)}
REGION = {"cpu-1": "a", "cpu-2": "b"}
SHAPE = LinkShape(bandwidth_gbps=0.02, latency_ms=10.0)
SECRET, API_KEY, MODEL = "wan-secret", "wan-key", "smollm2-135m"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30 + "Now tell me about the fox:"


def _write_cluster(root: Path) -> tuple[Path, Path]:
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import finish_plan

    raw = {
        "name": "wan-pair", "model": MODEL, "profiles": str(DEMO / "profiles-smollm2.yaml"),
        "coordinator": {"id": "coordinator", "region": "a"},
        "nodes": [{"id": n, "gpu": "cpu", "region": REGION[n]} for n in PLACEMENT],
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 0.1},
                     "inter_region": {"bandwidth_gbps": SHAPE.bandwidth_gbps, "latency_ms": SHAPE.latency_ms}},
    }  # fmt: skip
    cluster_path = root / "cluster.yaml"
    cluster_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cluster = load_cluster(cluster_path)
    plan_path = root / "plan.json"
    finish_plan(cluster, load_profiles_for(cluster), PLACEMENT, method="manual").save(plan_path)
    return cluster_path, plan_path


@contextlib.contextmanager
def _serving(cluster_path: Path, plan_path: Path, workdir: Path, wan: Wan | None) -> Iterator[str]:
    """The two agents and a coordinator (HTTP on 127.0.0.1 of region a, or of this namespace)."""
    from helix.plan import load_plan
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from router.launch import AgentProcesses
    from router.serving import ServeOptions, build_coordinator, create_server_app, make_server

    workdir.mkdir(parents=True, exist_ok=True)
    agents = AgentProcesses(cluster_path, plan_path, workdir, secret=SECRET)
    if wan is not None:
        agents.bind_hosts = {n: wan.address(REGION[n]) for n in PLACEMENT}
        agents.command_prefix = {n: wan.exec_prefix(REGION[n]) for n in PLACEMENT}
    server: Any = None
    thread: threading.Thread | None = None
    try:
        agents.start(PLACEMENT)
        addresses = agents.wait_ready(timeout_s=240)
        cluster = load_cluster(cluster_path)
        coordinator = build_coordinator(cluster, load_plan(plan_path), load_profiles_for(cluster), ServeOptions())
        app = create_server_app(coordinator, addresses, secret=SECRET.encode(), api_keys=[API_KEY],
                                reply_host=wan.address("a") if wan else "127.0.0.1")  # fmt: skip
        server = make_server(app, "127.0.0.1", 0)

        def serve() -> None:
            with wan.entered("a") if wan else contextlib.nullcontext():
                asyncio.run(server.serve())

        thread = threading.Thread(target=serve, name="uvicorn-wan", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not (server.started and coordinator.ready):
            assert time.monotonic() < deadline, "coordinator did not become ready"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
        agents.stop()


def _answers(base_url: str) -> list[tuple[str, list[str]]]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    out = []
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a short poem "
                                          "about the sea."}], max_tokens=24, temperature=0)  # fmt: skip
    long = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    for text, resp in ((chat.choices[0].message.content or "", chat), (long.choices[0].text, long)):
        out.append((text, [s["node"] for s in resp.model_extra["helix"]["pipelines"][0]]))
    return out


def test_greedy_answer_across_a_shaped_link_equals_loopback(tmp_path: Path) -> None:
    cluster_path, plan_path = _write_cluster(tmp_path)
    with _serving(cluster_path, plan_path, tmp_path / "loopback", None) as url:
        expected = _answers(url)

    links = {("a", "b"): SHAPE, ("b", "a"): SHAPE}
    with Wan(["a", "b"], links) as wan:
        with _serving(cluster_path, plan_path, tmp_path / "wan", wan) as url, wan.entered("a"):
            got = _answers(url)
        crossed = wan.link_bytes("a", "b")
        token = wan.token
    assert got == expected
    assert [p for _, p in got] == [["cpu-1", "cpu-2"]] * 2
    # the long prompt's activations alone (~330 tokens x 576 floats) crossed a -> b
    assert crossed > 330 * 576 * 4
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{NS_PREFIX}{token}" not in left
