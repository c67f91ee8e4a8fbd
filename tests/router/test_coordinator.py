"""The coordinator's asyncio bridge and HTTP face over the real core, without sockets or sleeps.

A recording stand-in for the transport keeps the messages the core sends; agents' TOKENS are
fabricated and fed on the loop's own thread, so every output reaches its request before the call
returns. Everything else (core, router, KV masking, tokenizer, stop strings, the FastAPI app) is real.
"""

from __future__ import annotations

import asyncio

import pytest

from helix import wire
from helix.errors import HelixError, OverloadedError
from router.agent_events import AgentJoined, KVReport
from router.coordinator import Coordinator
from router.request import Finish, GenerationRequest
from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir
from tests.factories import DEMO_FLOWS, DEMO_PLACEMENT, demo_router, tokens, welcome


class RecordingIO:
    """The transport's surface the coordinator uses; ADMITs are kept by wire id."""

    reply_to = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.admitted: dict[str, wire.Admit] = {}
        self.cancelled: list[str] = []

    def send(self, messages: list[tuple[str, wire.Message]], *, from_io_thread: bool = False) -> None:
        for _, msg in messages:
            if isinstance(msg, wire.Admit):
                self.admitted[msg.request_id] = msg
            elif isinstance(msg, wire.Cancel):
                self.cancelled.append(msg.request_id)

    def send_task(self, node: str, msg: object) -> None:
        pass

    def alive_nodes(self) -> set[str]:
        return set(DEMO_PLACEMENT)

    def kv_reports(self) -> dict[str, KVReport]:
        return {}


def _coordinator(kv_entries: float, queue_bound: int = 1) -> tuple[Coordinator, RecordingIO]:
    tok = ChatTokenizer.from_dir(ensure_tokenizer_dir(None))
    coord = Coordinator(demo_router(kv_entries), tok, model_names=["m"], max_context_tokens=8192, max_tokens_cap=100,
                        planned_flows=DEMO_FLOWS, queue_bound=queue_bound, admission_timeout_s=5)  # fmt: skip
    io = RecordingIO()
    coord.attach(io, asyncio.get_running_loop())  # type: ignore[arg-type]
    for node, layers in DEMO_PLACEMENT.items():
        coord.on_agent_event(AgentJoined(node, welcome(node, layers, int(kv_entries // (layers[1] - layers[0])))))
    return coord, io


def emit(coord: Coordinator, io: RecordingIO, wire_id: str, token: int, *, finished: bool = False) -> None:
    """The last stage of ``wire_id``'s pipeline sends ``token``."""
    last = io.admitted[wire_id].pipeline[-1].stage.node
    coord.on_agent_event(tokens(last, wire_id, token, finished=finished, reason="length" if finished else ""))


def test_a_waiting_request_is_admitted_when_kv_frees_and_overflow_gets_429() -> None:
    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=20 * 30)  # every node fits one request of 10 + 10 tokens, not two
        gen = GenerationRequest(prompt_ids=list(range(1, 11)), max_tokens=10, temperature=0.0)
        first = await coord.admit(gen)
        second = await coord.admit(gen)
        assert len(io.admitted) == 2
        waiting = asyncio.ensure_future(coord.admit(gen))
        await asyncio.sleep(0)  # let it run up to its wait
        assert not waiting.done() and coord.health_details()["waiting"] == 1
        with pytest.raises(OverloadedError) as exc:  # queue bound 1: refused, with Retry-After
            await coord.admit(gen)
        assert exc.value.http_status == 429 and exc.value.retry_after_s >= 1
        emit(coord, io, f"{first.request_id}.1", 42, finished=True)  # the first request ends: its KV is released
        third = await waiting
        assert len(io.admitted) == 3
        events = [e async for e in first.events()]
        assert isinstance(events[-1], Finish) and events[-1].completion_tokens == 1
        second.cancel()
        third.cancel()
        assert not coord.router.pipelines and coord.health_details() == {
            "nodes": dict.fromkeys(DEMO_PLACEMENT, True), "running": 0, "waiting": 0, "tasks": {}}

    asyncio.run(scenario())


def test_stop_strings_end_the_stream_and_cancel_the_pipeline() -> None:
    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=1e9, queue_bound=8)
        handle = await coord.admit(GenerationRequest(prompt_ids=[1, 2], max_tokens=50, stop=("lo w",)))
        wire_id = f"{handle.request_id}.1"
        for t in coord.tokenizer.encode("hello world and more"):
            if not coord.core.requests:
                break
            emit(coord, io, wire_id, t)
        events = [e async for e in handle.events()]
        assert "".join(e for e in events if isinstance(e, str)) == "hel"
        assert isinstance(events[-1], Finish) and events[-1].reason == "stop" and wire_id in io.cancelled

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
            while coord.health_details()["waiting"] < 1:  # two running (nothing answers yet), one waiting
                await asyncio.sleep(0)
            assert coord.health_details()["running"] == 2
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["type"] == "rate_limit_error"
            answered: set[str] = set()
            while len(answered) < 3:  # answer each attempt once it is admitted
                for wire_id in [w for w in io.admitted if w not in answered]:
                    answered.add(wire_id)
                    emit(coord, io, wire_id, 42, finished=True)
                await asyncio.sleep(0)
            done = await asyncio.gather(*held)
            assert [r.status_code for r in done] == [200, 200, 200]
        counted = {code: coord.metrics.registry.get_sample_value(
            "helix_http_responses_total", {"route": "/v1/completions", "code": code}) for code in ("200", "429")}
        assert counted == {"200": 3.0, "429": 1.0}  # the refusal is counted with its code

    asyncio.run(scenario())


def test_a_request_whose_tokens_stop_coming_ends_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from router import coordinator

    monkeypatch.setattr(coordinator, "STALL_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        coord, io = _coordinator(kv_entries=1e9, queue_bound=8)
        handle = await coord.admit(GenerationRequest(prompt_ids=[1, 2], max_tokens=50))
        wire_id = f"{handle.request_id}.1"
        emit(coord, io, wire_id, coord.tokenizer.encode("ok")[0])  # one token, then nothing
        seen: list[object] = []
        with pytest.raises(HelixError, match="produced no token for"):
            async for event in handle.events():
                seen.append(event)
        assert seen and isinstance(seen[0], str)  # the token before the stall arrived
        assert wire_id in io.cancelled  # and the stalled request was cancelled everywhere

    asyncio.run(scenario())
