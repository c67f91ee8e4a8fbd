"""The OpenAI-compatible endpoint with the real ``openai`` client, real agents and SmolLM2-135M."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models_and_health(serving_cluster) -> None:
    client = serving_cluster.client()
    assert MODEL in [m.id for m in client.models.list().data]
    health = serving_cluster.health()
    assert health["status"] == "ready"
    assert all(health["nodes"].values())


def test_chat_streaming_matches_non_streaming(serving_cluster) -> None:
    client = serving_cluster.client()
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 10
    pipelines = full.model_extra["helix"]["pipelines"]
    assert pipelines and pipelines[0][0]["layers"][0] == 0 and pipelines[0][-1]["layers"][1] == 30

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert "".join(parts) == text  # greedy: the same answer either way
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_text_and_token_prompts(serving_cluster) -> None:
    client = serving_cluster.client()
    prompt = "The capital of France is"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert first.choices[0].text
    ids = serving_cluster.coordinator.tokenizer.encode(prompt)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == first.choices[0].text


def test_stop_string_truncates(serving_cluster) -> None:
    client = serving_cluster.client()
    prompt = "Count: 1, 2, 3, 4,"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    cut = base.strip()[:2]  # a stop string the greedy output certainly contains
    assert cut
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[cut])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(cut)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[cut], stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_metrics_in_prometheus_format(serving_cluster) -> None:
    client = serving_cluster.client()
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    with serving_cluster.http() as http:
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {f: [(s.name, s.labels, s.value) for s in fam.samples] for f, fam in families.items()}
    assert any(v >= 1 for n, lab, v in samples["helix_requests"] if lab.get("status") == "ok")
    assert any(n == "helix_generated_tokens_total" and v >= 4 for n, _, v in samples["helix_generated_tokens"])
    assert any(n.endswith("_count") and v >= 1 for n, _, v in samples["helix_time_to_first_token_seconds"])
    assert any(n.endswith("_count") and v >= 1 for n, _, v in samples["helix_time_per_output_token_seconds"])
    assert {lab["node"] for _, lab, _ in samples["helix_node_kv_usage_ratio"]} == {"cpu-0", "cpu-1", "cpu-2"}
    planned = {(lab["src"], lab["dst"]) for _, lab, _ in samples["helix_edge_planned_flow_tok_s"]}
    observed = {(lab["src"], lab["dst"]): v for _, lab, v in samples["helix_edge_observed_flow_tok_s"]}
    assert ("coordinator", "cpu-0") in planned or ("coordinator", "cpu-1") in planned
    assert planned <= set(observed) and any(v > 0 for v in observed.values())
    assert [v for _, _, v in samples["helix_ready"]] == [1.0]
