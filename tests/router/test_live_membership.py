"""Nodes die, join and leave a serving cluster (issue 18), with real agents on loopback (SmolLM2) and
the coordinator re-planning (router.membership): a killed agent is planned around after the grace
period, a joining agent (``helix agent --join``) is given layers and served through after the
switch, an agent leaving on SIGTERM loses no request; and the issue's chaos test, 16 streaming
clients throughout an agent killed, one joining and one leaving. Every request finishes with the
greedy output of an undisturbed run of its prompt.

The cluster starts on the test placement (``cpu-0 [0, 30)``, ``cpu-1 [0, 16)``, ``cpu-2 [16, 30)``;
cpu-1 and cpu-2 hold at most 16 layers); the policy is the default's, faster: a 1 s grace period,
re-plans 0.5 s apart with a 1 s planner limit, a 5 s drain of released layers.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import API_KEY, MODEL, ServingCluster

PROMPTS = [f"Write one sentence about {topic}." for topic in
           ("the sea", "mountains", "a cat", "rain", "bread", "trains", "the moon", "music")]  # fmt: skip
MAX_TOKENS = 16
NUM_LAYERS = 30


def _policy() -> Any:
    from router.membership_types import MembershipPolicy

    return MembershipPolicy(grace_s=1.0, min_interval_s=0.5, replan_time_limit_s=1.0, drain_s=5.0)


def _serve(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path, cluster_server: Any) -> Iterator[ServingCluster]:
    from router.serving import ServeOptions

    yield from cluster_server(tmp_path_factory, demo_cluster, options=ServeOptions(max_tokens_cap=4096,
                                                                                   membership=_policy()))


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path, cluster_server: Any) -> Iterator[ServingCluster]:
    yield from _serve(tmp_path_factory, demo_cluster, cluster_server)


@pytest.fixture(scope="module")
def references(elastic: ServingCluster) -> dict[str, str]:
    """Each prompt's greedy answer on the undisturbed cluster."""
    answers = {p: _answer(elastic, p)[0] for p in PROMPTS}
    assert all(len(a) > 20 for a in answers.values()), answers
    return answers


def _answer(cluster: ServingCluster, prompt: str) -> tuple[str, list[list[str]]]:
    """Stream ``prompt``'s greedy answer; the text and the pipelines (node lists) it ran on."""
    parts, info = [], None
    stream = cluster.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=MAX_TOKENS, temperature=0, stream=True)  # fmt: skip
    for chunk in stream:
        info = (chunk.model_extra or {}).get("helix") or info
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    pipelines = [[s["node"] for s in p] for p in (info or {}).get("pipelines", [])]
    return "".join(parts), pipelines


class Clients:
    """``n`` threads streaming the prompts round robin until stopped; every answer or error kept."""

    def __init__(self, cluster: ServingCluster, n: int) -> None:
        self.cluster, self.stop = cluster, threading.Event()
        self.results: list[tuple[str, str, list[list[str]]]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            try:
                text, pipelines = _answer(self.cluster, prompt)
                self.results.append((prompt, text, pipelines))
            except Exception as exc:  # every failure is a lost request
                self.errors.append(f"{prompt!r}: {type(exc).__name__}: {exc}")

    def wait_for(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.results) < n and not self.errors and time.monotonic() < deadline:
            time.sleep(0.05)

    def check(self, references: dict[str, str]) -> None:
        assert not self.errors, self.errors[:3]
        wrong = [(p, t, references[p]) for p, t, _ in self.results if t != references[p]]
        assert not wrong, wrong[:3]


def _view(cluster: ServingCluster) -> dict[str, Any]:
    with cluster.http() as http:
        return dict(http.get("/v1/cluster").json())


def _members(cluster: ServingCluster) -> dict[str, str]:
    return {m["node"]: m["state"] for m in _view(cluster)["members"]}


def _settled(cluster: ServingCluster) -> bool:
    view = _view(cluster)
    return view["reconfiguration"] is None and all(m["state"] == "serving" for m in view["members"]
                                                   if m["node"] in view["plan"]["placement"])  # fmt: skip


def _covers_without(placement: dict[str, list[int]], node: str) -> bool:
    held = [r for n, r in placement.items() if n != node]
    return all(any(s <= layer < e for s, e in held) for layer in range(NUM_LAYERS))


def test_a_killed_agent_is_planned_around_after_the_grace_period(elastic: ServingCluster,
                                                                 references: dict[str, str]) -> None:  # fmt: skip
    with Clients(elastic, 4) as clients:
        clients.wait_for(4)
        elastic.agents.kill("cpu-0")  # kill -9
        elastic.wait_until(lambda: _view(elastic)["version"] >= 1 and "cpu-0" not in _members(elastic),
                           timeout_s=60, what="a re-plan without cpu-0")  # fmt: skip
        n = len(clients.results)
        clients.wait_for(n + 4)
    clients.check(references)
    view = _view(elastic)
    assert sorted(view["plan"]["placement"]) == ["cpu-1", "cpu-2"] and "cpu-0 died" in str(view["history"])
    assert elastic.health()["status"] == "ready"
    metrics = httpx.get(f"{elastic.base_url}/metrics", timeout=10).text
    assert f"helix_plan_version {float(view['version'])}" in metrics and 'helix_node_alive{node="cpu-0"}' not in metrics


def _task_answer(cluster: ServingCluster, prompt: str) -> tuple[str, list[str]]:
    out = cluster.client().chat.completions.create(model="sea-lora", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    return out.choices[0].message.content or "", [s["node"] for s in out.model_extra["helix"]["pipelines"][-1]]


def test_a_joining_node_serves_after_the_switch(elastic: ServingCluster, references: dict[str, str],
                                                tmp_path: Path) -> None:  # fmt: skip
    """... and a fine-tuned task loaded before it joined runs on its new layers alike."""
    from node_agent.task_files import save_pet
    from tests.router.pet_tasks import ATTENTION, load, random_lora, smollm2_hf

    lora = save_pet(tmp_path / "sea-lora", "lora", random_lora(smollm2_hf(), seed=3, rank=4, modules=ATTENTION))
    assert load(elastic, "sea-lora", lora).status_code == 200
    task_reference = _task_answer(elastic, PROMPTS[0])[0]
    assert task_reference != references[PROMPTS[0]]
    version = _view(elastic)["version"]
    elastic.agents.start_joining("cpu-3", elastic.base_url, "cpu", api_key=API_KEY)
    elastic.wait_until(lambda: "cpu-3" in _view(elastic)["plan"]["placement"] and _settled(elastic),
                       timeout_s=120, what="cpu-3 planned in and serving")  # fmt: skip
    view = _view(elastic)
    assert view["version"] > version and _members(elastic)["cpu-3"] == "serving"
    used = set()
    for prompt in PROMPTS * 3:  # IWRR sends some through the new node
        text, pipelines = _answer(elastic, prompt)
        assert text == references[prompt]
        used |= set(pipelines[0])
        if "cpu-3" in used:
            break
    assert "cpu-3" in used
    for _ in range(12):  # the task too
        text, nodes = _task_answer(elastic, PROMPTS[0])
        assert text == task_reference
        if "cpu-3" in nodes:
            break
    assert "cpu-3" in nodes


def test_an_agent_leaving_on_sigterm_loses_no_request(elastic: ServingCluster, references: dict[str, str]) -> None:
    placement = _view(elastic)["plan"]["placement"]
    leaver = next(n for n in sorted(placement) if _covers_without(placement, n))
    with Clients(elastic, 4) as clients:
        clients.wait_for(2)
        elastic.agents.agents[leaver].popen.send_signal(signal.SIGTERM)  # it drains, then exits
        elastic.wait_until(lambda: leaver not in _members(elastic) and _settled(elastic), timeout_s=90,
                           what=f"{leaver} gone and the plan switched")  # fmt: skip
        n = len(clients.results)
        clients.wait_for(n + 4)
    clients.check(references)
    assert elastic.agents.agents[leaver].popen.wait(timeout=30) == 0  # it drained and exited cleanly
    assert f"{leaver} left" in str(_view(elastic)["history"])


def test_too_few_nodes_answer_503_naming_what_is_missing_until_a_node_joins(elastic: ServingCluster,
                                                                            references: dict[str, str]) -> None:  # fmt: skip
    members = _members(elastic)
    survivor = next(n for n in ("cpu-1", "cpu-2") if n in members)  # holds at most 16 of the 30 layers
    for node in sorted(members):
        if node != survivor:
            elastic.agents.kill(node)
    elastic.wait_until(lambda: _view(elastic)["unavailable"] is not None, timeout_s=60, what="unavailable")
    with elastic.http() as http:
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        health = http.get("/health")
    message = refused.json()["error"]["message"]
    assert refused.status_code == 503 and "no live node holds layers" in message and "cannot serve the model" in message
    assert health.status_code == 503 and health.json()["unavailable"]
    elastic.agents.start_joining("cpu-5", elastic.base_url, "cpu", api_key=API_KEY)
    elastic.wait_until(lambda: elastic.health()["status"] == "ready" and _settled(elastic), timeout_s=120,
                       what="served again after cpu-5 joined")  # fmt: skip
    assert _view(elastic)["unavailable"] is None
    assert _answer(elastic, PROMPTS[0])[0] == references[PROMPTS[0]]


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path, cluster_server: Any) -> Iterator[ServingCluster]:
    yield from _serve(tmp_path_factory, demo_cluster, cluster_server)


def test_chaos_16_streaming_clients_through_a_kill_a_join_and_a_leave(fresh: ServingCluster,
                                                                      references: dict[str, str]) -> None:  # fmt: skip
    """The issue's chaos test (its references come from the undisturbed module cluster: same model,
    same greedy answers)."""
    t0 = time.monotonic()
    with Clients(fresh, 16) as clients:
        clients.wait_for(16)
        fresh.agents.kill("cpu-2")
        fresh.wait_until(lambda: "cpu-2" not in _members(fresh) and _settled(fresh), timeout_s=60,
                         what="a re-plan without cpu-2")  # fmt: skip
        fresh.agents.start_joining("cpu-4", fresh.base_url, "cpu", api_key=API_KEY)
        fresh.wait_until(lambda: "cpu-4" in _view(fresh)["plan"]["placement"] and _settled(fresh), timeout_s=120,
                         what="cpu-4 planned in")  # fmt: skip
        placement = _view(fresh)["plan"]["placement"]
        leaver = next(n for n in sorted(placement) if n != "cpu-4" and _covers_without(placement, n))
        fresh.agents.agents[leaver].popen.send_signal(signal.SIGTERM)
        fresh.wait_until(lambda: leaver not in _members(fresh) and _settled(fresh), timeout_s=90,
                         what=f"{leaver} gone")  # fmt: skip
        n = len(clients.results)
        clients.wait_for(n + 16)
    clients.check(references)
    history = str(_view(fresh)["history"])
    assert "cpu-2 died" in history and "cpu-4 (cpu) asks to join" in history and f"{leaver} left" in history
    print(f"chaos: {len(clients.results)} requests, 0 lost, 0 wrong, {time.monotonic() - t0:.1f} s; "
          f"final placement {_view(fresh)['plan']['placement']}")
