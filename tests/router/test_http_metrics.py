"""``GET /metrics`` with real agents: every HTTP response counted by route and code (4xx too),
and each node's engine steps (time, batch sequences and tokens) and queue lengths, learnt from
the agents' heartbeats."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helix import wire

MODEL = "smollm2-135m"
NODES = {"cpu-0", "cpu-1", "cpu-2"}
MAX_TOKENS = 6


def _scrape(cluster: Any) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=30).text
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def _responses(scrape: dict[str, list[tuple[str, dict[str, str], float]]]) -> dict[tuple[str, str], float]:
    return {(lab["route"], lab["code"]): v for n, lab, v in scrape["helix_http_responses"] if n.endswith("_total")}


def _histograms(scrape: dict[str, list[tuple[str, dict[str, str], float]]], family: str) -> dict[str, dict[str, Any]]:
    """node -> {"count", "sum", "buckets": [(le, cumulative count)]} of one per-node histogram."""
    out: dict[str, dict[str, Any]] = {}
    for name, labels, value in scrape[family]:
        node = out.setdefault(labels["node"], {"buckets": []})
        if name.endswith("_bucket"):
            node["buckets"].append((float(labels["le"]), value))
        else:
            node[name.rsplit("_", 1)[1]] = value
    return out


def _gauge(scrape: dict[str, list[tuple[str, dict[str, str], float]]], family: str) -> dict[str, float]:
    return {labels["node"]: value for _, labels, value in scrape[family]}


def _idle(cluster: Any) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """A scrape taken once every agent's latest heartbeat says nothing waits or runs there (its
    step counts are then final: the agent publishes them before its queue lengths)."""
    result: dict[str, Any] = {}

    def idle() -> bool:
        result["scrape"] = scrape = _scrape(cluster)
        queued, running = _gauge(scrape, "helix_node_queue_requests"), _gauge(scrape, "helix_node_running_requests")
        return set(queued) == set(running) == NODES and not any(queued.values()) and not any(running.values())

    cluster.wait_until(idle, timeout_s=60, what="every agent to report an empty queue")
    return result["scrape"]


def test_4xx_responses_are_counted_by_route_and_code(serving_cluster) -> None:
    before = _responses(_scrape(serving_cluster))
    with serving_cluster.http() as http:
        assert http.post("/v1/completions", content=b"{not json").status_code == 400
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}).status_code == 400
        assert http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 404
        assert http.get("/v1/no-such-route").status_code == 404
    assert httpx.get(f"{serving_cluster.base_url}/v1/models", timeout=10).status_code == 401  # no API key
    with pytest.raises(openai.NotFoundError):
        serving_cluster.client().completions.create(model="gpt-9", prompt="x", max_tokens=1)
    after = _responses(_scrape(serving_cluster))
    delta = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    assert delta.pop(("/metrics", "200")) == 1  # the first scrape; the second counts after it rendered
    assert delta == {("/v1/completions", "400"): 2, ("/v1/chat/completions", "404"): 1, ("other", "404"): 1,
                     ("/v1/models", "401"): 1, ("/v1/completions", "404"): 1}


def test_node_step_time_batch_size_and_queue_length(serving_cluster) -> None:
    before = _idle(serving_cluster)
    served: dict[str, list[tuple[int, int]]] = {node: [] for node in NODES}  # node -> (prompt, completion) tokens
    prompts = ["The capital of France is", "One, two, three,", "Colors of the rainbow:", "def add(a, b):"]

    def complete(prompt: str) -> dict[str, Any]:
        with serving_cluster.http() as http:
            resp = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0})
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(4) as pool:  # concurrent, so the agents batch several requests per step
        for _ in range(3):  # IWRR spreads requests over the pipelines; three rounds reach every node
            for body in pool.map(complete, prompts):
                usage = body["usage"]
                (pipeline,) = body["helix"]["pipelines"]
                for stage in pipeline:
                    served[stage["node"]].append((usage["prompt_tokens"], usage["completion_tokens"]))
    assert all(served.values()), served  # every node ran some request
    after = _idle(serving_cluster)

    steps = {field: (_histograms(before, name), _histograms(after, name))
             for field, name in (("seconds", "helix_node_step_seconds"), ("sequences", "helix_node_batch_sequences"),
                                 ("tokens", "helix_node_batch_tokens"))}
    for field, (_, new) in steps.items():
        assert set(new) == NODES, field
        bounds = wire.STEP_STATS_BOUNDS[field]
        for hist in new.values():
            les = [le for le, _ in hist["buckets"]]
            counts = [c for _, c in hist["buckets"]]
            assert les == [*map(float, bounds), float("inf")]
            assert counts == sorted(counts) and counts[-1] == hist["count"]  # cumulative buckets, +Inf = count
    for node in NODES:
        ran = {field: {k: new[node][k] - old.get(node, {}).get(k, 0.0) for k in ("count", "sum")}
               for field, (old, new) in steps.items()}
        n_steps = ran["seconds"]["count"]
        assert n_steps > 0 and ran["sequences"]["count"] == ran["tokens"]["count"] == n_steps, (node, ran)
        assert 0 < ran["seconds"]["sum"] < 60 * n_steps, (node, ran)
        # each stage of a request runs its prompt in one step, then one step per generated token but
        # the last: as many steps as tokens generated, with prompt + generated - 1 tokens in all
        assert ran["sequences"]["sum"] == sum(c for _, c in served[node]), (node, ran, served[node])
        assert ran["tokens"]["sum"] == sum(p + c - 1 for p, c in served[node]), (node, ran, served[node])
        assert 1 <= ran["sequences"]["sum"] / n_steps <= 32  # at most the agents' max_batch_size
    assert _gauge(after, "helix_node_queue_requests") == dict.fromkeys(NODES, 0.0)
