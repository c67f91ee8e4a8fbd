"""kill -9 of an agent mid-generation: the request moves to a new pipeline, is re-prefilled from
prompt + tokens so far, and finishes with the same greedy output; a returning agent is used
again; with no complete pipeline left clients get a clear 503 and /health says not ready."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def _restart(cluster, *nodes: str) -> None:
    for node in nodes:
        cluster.agents.start_one(node)
    cluster.agents.wait_ready(timeout_s=240)
    cluster.wait_until(lambda: all(cluster.health()["nodes"][n] for n in nodes), what=f"{nodes} back")


def test_kill_mid_generation_same_greedy_output(serving_cluster) -> None:
    client = serving_cluster.client()
    reference = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=32, temperature=0)
    expected = reference.choices[0].message.content

    stream = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=32, temperature=0, stream=True)
    parts: list[str] = []
    victim = None
    final_info = None
    for chunk in stream:
        info = (chunk.model_extra or {}).get("helix")
        if info and victim is None:
            first_pipeline = [s["node"] for s in info["pipelines"][0]]
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 3 and victim is None:
                victim = first_pipeline[-1]
                serving_cluster.agents.kill(victim)  # kill -9
        if chunk.choices and chunk.choices[0].finish_reason:
            final_info = info
    assert victim is not None, "the answer was too short to kill an agent mid-generation"
    assert "".join(parts) == expected
    pipelines = [[s["node"] for s in p] for p in final_info["pipelines"]]
    assert len(pipelines) >= 2 and victim in pipelines[0] and victim not in pipelines[-1]
    assert final_info["reroutes"] >= 1

    health = serving_cluster.health()
    assert health["status"] == "ready" and health["nodes"][victim] is False

    _restart(serving_cluster, victim)
    used = set()
    for _ in range(12):  # IWRR comes back to the returning node
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)
        used |= {s["node"] for s in out.model_extra["helix"]["pipelines"][0]}
        if victim in used:
            break
    assert victim in used


def test_penalties_count_the_tokens_generated_before_a_failover(serving_cluster) -> None:
    """The sampling stage dies mid-answer: the new pipeline's last stage gets the tokens generated so
    far with the re-prefill, so the frequency penalty keeps counting them and the answer is the one
    an uninterrupted run gives (a stage that forgot them would go back to repeating " one")."""
    client = serving_cluster.client()
    ask = dict(model=MODEL, prompt="one, one, one, one, one, one, one,", max_tokens=32, temperature=0,
               frequency_penalty=1.0, presence_penalty=0.2)
    expected = client.completions.create(**ask).choices[0].text
    parts: list[str] = []
    victim, info = None, None
    for chunk in client.completions.create(**ask, stream=True):
        info = (chunk.model_extra or {}).get("helix") or info
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            if len(parts) == 6 and victim is None:
                victim = info["pipelines"][0][-1]["node"]  # the stage that samples
                serving_cluster.agents.kill(victim)
    assert victim is not None, "the answer was too short to kill an agent mid-generation"
    assert info is not None and info["reroutes"] >= 1 and victim not in [s["node"] for s in info["pipelines"][-1]]
    assert "".join(parts) == expected
    _restart(serving_cluster, victim)


def test_no_pipeline_left_then_recovery(serving_cluster) -> None:
    client = serving_cluster.client()
    stream = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=400, temperature=0, stream=True)
    with pytest.raises(openai.APIError) as in_flight:
        for n, _chunk in enumerate(stream):
            if n == 2:  # cpu-2 alone holds only layers [16, 30): no complete pipeline is left
                serving_cluster.agents.kill("cpu-0")
                serving_cluster.agents.kill("cpu-1")
    assert "no complete pipeline" in str(in_flight.value)

    serving_cluster.wait_until(lambda: serving_cluster.health()["status"] == "not ready", what="not ready")
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=2)
    assert refused.value.status_code == 503 and "no complete pipeline" in refused.value.message

    _restart(serving_cluster, "cpu-0", "cpu-1")
    assert serving_cluster.health()["status"] == "ready"
    out = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=2, temperature=0)
    assert out.choices[0].message.content is not None


@pytest.mark.vllm
def test_kill_a_vllm_agent_mid_generation_same_greedy_output(vllm_serving_cluster) -> None:
    """The same on vLLM-backed agents (every node's `backend: vllm` in the cluster file)."""
    test_kill_mid_generation_same_greedy_output(vllm_serving_cluster)
