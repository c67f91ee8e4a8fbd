"""Bad requests get 4xx with an OpenAI-style error body that says what was wrong; the server keeps
serving. Also: API keys, and a client that disconnects mid-stream frees its request everywhere."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
API_KEY = "test-key"  # the serving cluster's (tests/router/conftest.py)
CHAT = [{"role": "user", "content": "Say hi."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"model": MODEL, "messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens", "exceeds"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ({"model": MODEL, "messages": CHAT, "n": 3}, 400, "n", "n=1"),
        ({"model": MODEL, "messages": CHAT, "temperature": 7}, 400, "temperature", "less than or equal to 2"),
        ({"model": MODEL, "messages": CHAT, "top_p": "high"}, 400, "top_p", "valid number"),
        ({"model": MODEL, "messages": CHAT, "seed": -1}, 400, "seed", "greater than or equal to 0"),
        ({"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
        ({"messages": CHAT}, 400, "model", "Field required"),
        ({"model": "gpt-9", "messages": CHAT}, 404, "model", "does not exist"),
        # fields that would change the output and that Helix does not implement: 400, never ignored
        ({"model": MODEL, "messages": CHAT, "tools": [TOOL]}, 400, "tools", "function calling"),
        ({"model": MODEL, "messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "function calling"),
        ({"model": MODEL, "messages": CHAT, "functions": [TOOL["function"]]}, 400, "functions", "function calling"),
        ({"model": MODEL, "messages": CHAT, "function_call": {"name": "f"}}, 400, "function_call", "function calling"),
        # response_format: JSON mode and structured outputs are implemented (test_http_structured_output.py);
        # malformed ones are 400s naming the sub-field
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format",
         'type "json_schema" needs a "json_schema" object'),
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a name", "schema": {"type": "object"}}}}, 400, "response_format", "response_format.json_schema.name"),
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
         400, "response_format", '"json_schema" is only read with type "json_schema"'),
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format",
         'response_format.json_schema.schema: the JSON schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
        ({"model": MODEL, "messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs", "not supported"),
        ({"model": MODEL, "messages": CHAT, "modalities": ["text", "audio"]}, 400, "modalities", '["text"]'),
        ({"model": MODEL, "messages": CHAT, "reasoning_effort": "high"}, 400, "reasoning_effort", "unknown field"),
        ({"model": MODEL, "messages": CHAT, "top_k": 5}, 400, "top_k", "unknown field"),
        ({"model": MODEL, "messages": CHAT, "temprature": 0}, 400, "temprature", "unknown field"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages",
         "messages.0.name: unknown field"),
        ({"model": MODEL, "messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty",
         "less than or equal to 2"),
        ({"model": MODEL, "messages": CHAT, "frequency_penalty": -3}, 400, "frequency_penalty",
         "greater than or equal to -2"),
        ({"model": MODEL, "messages": CHAT, "logit_bias": {"49152": 5}}, 400, "logit_bias",
         "token id 49152 is outside the vocabulary [0, 49152)"),
        ({"model": MODEL, "messages": CHAT, "logit_bias": {"hello": 5}}, 400, "logit_bias", "'hello' is not a token id"),
        ({"model": MODEL, "messages": CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias",
         "logit_bias.5: Input should be less than or equal to 100"),
    ],
)
def test_bad_chat_bodies(serving_cluster, body, status, param, words) -> None:
    with serving_cluster.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    err = _error(resp)
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logit_bias": {"-1": 3}}, "logit_bias", "'-1' is not a token id"),
        ({"logit_bias": {"99999": 3}}, "logit_bias", "token id 99999 is outside the vocabulary"),
        ({"presence_penalty": -2.01}, "presence_penalty", "greater than or equal to -2"),
        ({"frequency_penalty": 2.01}, "frequency_penalty", "less than or equal to 2"),
        ({"tools": [TOOL]}, "tools", "unknown field"),  # not a completions field at all
        ({"response_format": {"type": "text"}}, "response_format", "unknown field"),
        ({"ignore_eos": True}, "ignore_eos", "unknown field"),
    ],
)
def test_bad_completion_bodies_name_the_field(serving_cluster, extra, param, words) -> None:
    with serving_cluster.http() as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **extra})
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param and words in err["message"], err


def test_fields_that_do_not_change_the_output_are_accepted(serving_cluster) -> None:
    """The documented allow-list (and the no-op values of rejected fields) as the openai client sends them."""
    client = serving_cluster.client()
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    same = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", safety_identifier="s", prompt_cache_key="c", parallel_tool_calls=False,
        response_format={"type": "text"}, modalities=["text"], tool_choice="none", logit_bias={},
        presence_penalty=0, frequency_penalty=0, logprobs=False)
    assert same.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, user="u1")
    assert text.choices[0].text is not None


def test_malformed_json_and_wrong_types(serving_cluster) -> None:
    with serving_cluster.http() as http:
        resp = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "not valid JSON" in _error(resp)["message"]
        resp = http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "JSON object" in _error(resp)["message"]
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]})
        assert resp.status_code == 400 and "vocabulary" in _error(resp)["message"]
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True})
        assert resp.status_code == 400 and "echo" in _error(resp)["message"]
        resp = http.post("/v1/completions", content=b"x" * (5 * 1024 * 1024), headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "limit" in _error(resp)["message"]


def test_oversized_prompt_and_context(serving_cluster) -> None:
    client = serving_cluster.client()
    long_prompt = "hello " * 9000  # > the model's 8192-token context
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    assert exc.value.status_code == 400 and "context" in exc.value.message
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hello " * 4000, max_tokens=4500)  # 8500 > 8192
    assert "max_tokens" in exc.value.message or exc.value.body["param"] == "max_tokens"


def test_openai_client_errors_then_still_serving(serving_cluster) -> None:
    client = serving_cluster.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10**7)
    assert "max_tokens" in exc.value.message
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert out.choices[0].message.content is not None


def test_api_key_enforced(serving_cluster) -> None:
    with pytest.raises(openai.AuthenticationError):
        serving_cluster.client(api_key="wrong").models.list()
    resp = httpx.post(f"{serving_cluster.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert resp.status_code == 401 and _error(resp)["code"] == "invalid_api_key"
    assert httpx.get(f"{serving_cluster.base_url}/health", timeout=10).status_code == 200  # health needs no key


def test_disconnect_cancels_everywhere(serving_cluster) -> None:
    coordinator = serving_cluster.coordinator
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2000, "temperature": 0, "stream": True}
    with serving_cluster.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                seen += 1
            if seen >= 3:
                break
        assert coordinator.health_details()["running"] >= 1
    # the client is gone: the coordinator drops the request and every agent frees its KV
    serving_cluster.wait_until(lambda: coordinator.health_details()["running"] == 0, what="request cancelled")
    serving_cluster.wait_until(
        lambda: all(r.used_tokens == 0 and r.reserved_tokens == 0 for r in coordinator.io.kv_reports().values()),
        what="agents freed the KV")
    assert not coordinator.router.pipelines  # and the router released its reservation


def test_a_client_gone_before_its_answer_is_dropped(serving_cluster) -> None:
    """Non-streaming: the handler notices the closed connection (the ASGI ``http.disconnect``,
    through the API-key middleware) and cancels the request everywhere."""
    coordinator = serving_cluster.coordinator
    dropped = coordinator.metrics.requests.labels("chat", "disconnected")
    before = dropped._value.get()
    # a long answer; the client hangs up once the coordinator is generating it (no read timeout to race)
    long_answer = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
    payload = json.dumps({"model": MODEL, "messages": long_answer, "max_tokens": 2000, "temperature": 0}).encode()
    host, port = serving_cluster.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        # generating: every stage has run its prompt and holds its KV (hanging up before the ADMIT reached
        # the agents would leave a prefill to run after this test, in the next test's step counts)
        serving_cluster.wait_until(lambda: any(r.output_ids for r in list(coordinator.core.requests.values())),
                                   what="the first token")
        generating_since = time.monotonic()
    serving_cluster.wait_until(lambda: coordinator.health_details()["running"] == 0, what="request dropped")
    assert dropped._value.get() == before + 1  # dropped as a disconnect, not finished

    def freed() -> bool:  # by heartbeats sent while or after the request ran, not stale ones from before it
        reports = coordinator.io.kv_reports().values()
        return all(r.used_tokens == r.reserved_tokens == 0 and r.age_s < time.monotonic() - generating_since
                   for r in reports)

    serving_cluster.wait_until(freed, what="agents freed the KV")
