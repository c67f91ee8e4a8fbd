"""The coordinator's admission queue and stop conditions, driven without sockets.

A recording stand-in for ``AgentsIO`` fabricates token events; everything else (router, KV
masking, tokenizer, stop strings) is real. KV capacities are tiny so masking happens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helix.errors import CapacityError, NoRouteError, OverloadedError
from router.agent_events import TokenEvent
from router.coordinator import Coordinator
from router.policy import Router
from router.request_state import Finish, GenerationRequest
from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
PLACEMENT = {"cpu-0": (0, 30), "cpu-1": (0, 16), "cpu-2": (16, 30)}


class RecordingIO:
    def __init__(self) -> None:
        self.submitted: dict[str, object] = {}
        self.cancelled: list[str] = []
        self.callbacks: dict[str, object] = {}

    def alive_nodes(self) -> set[str]:
        return set(PLACEMENT)

    def submit(self, wire_id, prompt_ids, sampling, pipeline, *, max_tokens, on_token, task="") -> None:
        self.submitted[wire_id] = pipeline
        self.callbacks[wire_id] = on_token

    def cancel(self, wire_id: str) -> None:
        self.cancelled.append(wire_id)

    def kv_reports(self) -> dict:
        return {}

    def emit(self, wire_id: str, token: int, *, finished: bool = False) -> None:
        self.callbacks[wire_id](TokenEvent(wire_id, token, 0, finished, "length" if finished else None))


def _coordinator(kv_entries: float, queue_bound: int = 1) -> tuple[Coordinator, RecordingIO]:
    from helix.plan import Plan
    from helix.spec import load_cluster

    cluster = load_cluster(REPO / "clusters" / "demo" / "cluster.yaml")
    flows = {("coordinator", "cpu-0"): 1.0, ("coordinator", "cpu-1"): 1.0, ("cpu-1", "cpu-2"): 1.0,
             ("cpu-0", "coordinator"): 1.0, ("cpu-2", "coordinator"): 1.0}
    plan = Plan(cluster="demo", model=cluster.model, method="manual", placement=PLACEMENT, max_flow_tok_s=2.0,
                flows=[{"src": s, "dst": d, "tok_s": f} for (s, d), f in flows.items()])
    router = Router.from_plan(plan, cluster, None, num_layers=30, kv_capacity=dict.fromkeys(PLACEMENT, kv_entries),
                              watermark=1.0)
    tok = ChatTokenizer.from_dir(ensure_tokenizer_dir(None))
    coord = Coordinator(router, tok, model_names=["m"], max_context_tokens=8192, max_tokens_cap=100,
                        planned_flows=flows, queue_bound=queue_bound, admission_timeout_s=5)
    io = RecordingIO()
    coord.attach(io, asyncio.get_running_loop())  # type: ignore[arg-type]
    return coord, io


def test_masked_requests_wait_then_overflow_gets_429() -> None:
    async def scenario() -> None:
        # every node fits one request of 10 + 10 tokens (x its layers), not two
        coord, io = _coordinator(kv_entries=20 * 30)
        gen = GenerationRequest(prompt_ids=list(range(1, 11)), max_tokens=10, temperature=0.0)
        first = await coord.admit(gen)
        second = await coord.admit(gen)  # cpu-0 is full; cpu-1 -> cpu-2 is free
        assert len(io.submitted) == 2
        waiting = asyncio.ensure_future(coord.admit(gen))  # every route is masked now: it waits
        await asyncio.sleep(0.05)
        assert not waiting.done() and coord.health_details()["waiting"] == 1
        with pytest.raises(OverloadedError) as exc:  # queue bound 1: refused, with Retry-After
            await coord.admit(gen)
        assert exc.value.http_status == 429 and exc.value.retry_after_s >= 1
        wire_id = next(iter(io.submitted))
        io.emit(wire_id, 42, finished=True)  # the first request ends: its KV is released
        await asyncio.sleep(0.05)
        third = await asyncio.wait_for(waiting, 1)
        assert len(io.submitted) == 3
        events = [e async for e in first.events()]
        assert isinstance(events[-1], Finish) and events[-1].completion_tokens == 1
        second.cancel()
        third.cancel()
        assert not coord.router.pipelines and coord.health_details() == {
            "nodes": dict.fromkeys(PLACEMENT, True), "running": 0, "waiting": 0, "tasks": {}}

    asyncio.run(scenario())


def test_never_fits_and_no_route() -> None:
    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=5 * 30)
        with pytest.raises(CapacityError):
            await coord.admit(GenerationRequest(prompt_ids=list(range(1, 11)), max_tokens=10))
        for node in ("cpu-0", "cpu-1"):
            coord.on_agent_dead(node)
        assert not coord.ready
        with pytest.raises(NoRouteError):
            await coord.admit(GenerationRequest(prompt_ids=[1], max_tokens=1))
        coord.on_agent_alive("cpu-0")
        assert coord.ready

    asyncio.run(scenario())


def test_stop_string_and_eos_end_the_request() -> None:
    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=1e9, queue_bound=8)
        tok = coord.tokenizer
        handle = await coord.admit(GenerationRequest(prompt_ids=[1, 2], max_tokens=50, stop=("lo w",)))
        wire_id = list(io.submitted)[-1]
        for t in tok.encode("hello world and more"):
            io.emit(wire_id, t)
        await asyncio.sleep(0.05)
        events = [e async for e in handle.events()]
        assert "".join(e for e in events if isinstance(e, str)) == "hel"
        assert events[-1].reason == "stop" and wire_id in io.cancelled

        handle = await coord.admit(GenerationRequest(prompt_ids=[1, 2], max_tokens=50))
        wire_id = list(io.submitted)[-1]
        for t in [*tok.encode("ok"), min(tok.eos_token_ids)]:
            io.emit(wire_id, t)
        await asyncio.sleep(0.05)
        events = [e async for e in handle.events()]
        assert "".join(e for e in events if isinstance(e, str)) == "ok" and events[-1].reason == "stop"

    asyncio.run(scenario())


def test_http_429_with_retry_after_when_the_queue_is_full() -> None:
    import httpx

    from router.app import create_app

    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=20 * 30)
        app = create_app(coord)
        body = {"model": "m", "prompt": list(range(1, 11)), "max_tokens": 10}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            held = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(0.2)  # two running (the fake agents never answer), one waiting
            assert coord.health_details()["running"] == 2 and coord.health_details()["waiting"] == 1
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["type"] == "rate_limit_error"
            for wire_id in list(io.submitted):
                io.emit(wire_id, 42, finished=True)
            await asyncio.sleep(0.1)
            for wire_id in list(io.submitted)[2:]:
                io.emit(wire_id, 42, finished=True)
            done = await asyncio.wait_for(asyncio.gather(*held), 5)
            assert [r.status_code for r in done] == [200, 200, 200]
        counted = {code: coord.metrics.registry.get_sample_value(
            "helix_http_responses_total", {"route": "/v1/completions", "code": code}) for code in ("200", "429")}
        assert counted == {"200": 3.0, "429": 1.0}  # the refusal is counted with its code

    asyncio.run(scenario())


def test_a_request_whose_tokens_stop_coming_ends_with_an_error(monkeypatch) -> None:
    from helix.errors import HelixError
    from router import request_state

    monkeypatch.setattr(request_state, "STALL_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=1e9, queue_bound=8)
        handle = await coord.admit(GenerationRequest(prompt_ids=[1, 2], max_tokens=50))
        wire_id = list(io.submitted)[-1]
        io.emit(wire_id, coord.tokenizer.encode("ok")[0])  # one token, then nothing
        seen: list[object] = []
        with pytest.raises(HelixError, match="produced no token for"):
            async for event in handle.events():
                seen.append(event)
        assert seen and isinstance(seen[0], str)  # the token before the stall arrived
        assert wire_id in io.cancelled  # and the stalled request was cancelled everywhere

    asyncio.run(scenario())
