"""The coordinator core stepped with fabricated agent events (no sockets, threads or sleeps).

The demo placement: ``cpu-0 [0, 30)`` alone, or ``cpu-1 [0, 16) -> cpu-2 [16, 30)``. KV capacities
are tiny where a test needs masking. Everything but the agents' messages is real (router, IWRR,
KV estimator, stop strings, tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helix import wire
from helix.domain import ErrorCode, FinishReason
from helix.errors import CapacityError, NoRouteError, OverloadedError, RequestError
from router.agent_events import AgentDied, AgentJoined, Unreachable
from router.core import CoordinatorCore
from router.core_interfaces import CoreOutput
from router.request import RequestStatus
from router.tokenizer import ChatTokenizer, IncrementalDetokenizer, ensure_tokenizer_dir
from tests.factories import DEMO_PLACEMENT, demo_router, joined_core, request, tokens, welcome

REPO = Path(__file__).resolve().parents[2]
FITS_ONE = 20 * 30  # KV entries per node: one request of 10 + 10 tokens on 30 layers, not two


def admits(out: CoreOutput) -> list[tuple[str, wire.Admit]]:
    return [(n, m) for n, m in out.messages if isinstance(m, wire.Admit)]


def of_type(out: CoreOutput, kind: type) -> list[tuple[str, wire.Message]]:
    return [(n, m) for n, m in out.messages if isinstance(m, kind)]


def last_node(admit: wire.Admit) -> str:
    return admit.pipeline[-1].stage.node


def test_masked_requests_wait_in_order_and_overflow_is_refused_with_retry_after() -> None:
    core = joined_core(demo_router(FITS_ONE), queue_bound=1, admission_timeout_s=5)
    core.add_request(request("a"), now=0.0)
    core.add_request(request("b"), now=0.0)  # one route is full; the other is free
    started = admits(core.schedule(0.0))
    assert len(started) == 2 and {a.request_id for _, a in started} == {"a.1", "b.1"}
    core.add_request(request("c"), now=0.0)  # every route is masked: it waits
    assert core.requests["c"].status is RequestStatus.WAITING and not core.schedule(0.0).messages
    with pytest.raises(OverloadedError) as exc:  # the queue holds one
        core.add_request(request("d"), now=0.0)
    assert exc.value.http_status == 429 and exc.value.retry_after_s >= 1 and "d" not in core.requests

    node_a, admit_a = next((n, a) for n, a in started if a.request_id == "a.1")
    core.update_from_output([tokens(last_node(admit_a), "a.1", 42, finished=True, reason="length")], now=1.0)
    out = core.schedule(1.0)  # a's KV is released: c starts
    assert [a.request_id for _, a in admits(out)] == ["c.1"]
    finish = next(o.finish for o in out.outputs if o.request_id == "a")
    assert finish is not None and finish.completion_tokens == 1 and finish.reason is FinishReason.LENGTH
    assert any(o.request_id == "c" and o.started for o in out.outputs)


def test_a_request_that_waits_past_its_deadline_gets_429() -> None:
    core = joined_core(demo_router(FITS_ONE), admission_timeout_s=5)
    for rid in "abc":
        core.add_request(request(rid), now=0.0)
    core.schedule(0.0)
    assert not core.schedule(4.9).outputs
    out = core.schedule(5.0)
    assert [(o.request_id, type(o.error)) for o in out.outputs] == [("c", OverloadedError)]
    assert "c" not in core.requests and not core.waiting


@pytest.mark.parametrize(("flag", "value"), [("--admission-timeout-s", "0"), ("--replan-grace-s", "-1")])
def test_serve_refuses_a_bad_timing_option_naming_it(flag: str, value: str) -> None:
    import argparse

    from helix.errors import ConfigError
    from router.commands import _options, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--cluster", "c.yaml", "--plan", "p.json", flag, value])
    with pytest.raises(ConfigError) as err:
        _options(args)
    assert err.value.field == flag and "must be positive" in str(err.value)
    good = _options(parser.parse_args(["--cluster", "c.yaml", "--plan", "p.json", "--admission-timeout-s", "120"]))
    assert good.admission_timeout_s == 120

def test_requests_that_can_never_fit_or_find_no_route_are_refused_at_once() -> None:
    core = joined_core(demo_router(5 * 30))
    with pytest.raises(CapacityError, match="does not fit in the KV cache"):
        core.add_request(request("big"), now=0.0)
    with pytest.raises(RequestError, match="no tokens"):
        core.add_request(request("empty", []), now=0.0)
    core.update_from_output([AgentDied("cpu-0"), AgentDied("cpu-1")], now=0.0)
    assert not core.ready
    with pytest.raises(NoRouteError, match="cpu-0, cpu-1"):
        core.add_request(request("x", [1], max_tokens=1), now=0.0)
    core.update_from_output([AgentJoined("cpu-0", welcome("cpu-0", (0, 30)))], now=0.0)
    assert core.ready


def test_no_node_is_used_before_its_agent_joins_and_a_wrong_range_is_not_used() -> None:
    core = CoordinatorCore(demo_router(1e9))
    assert not core.ready
    core.update_from_output([AgentJoined("cpu-0", welcome("cpu-0", (0, 20)))], now=0.0)  # plan says [0, 30)
    assert not core.ready
    core.update_from_output([AgentJoined("cpu-0", welcome("cpu-0", (0, 30)))], now=0.0)
    assert core.ready and core.agents.addresses["cpu-0"].endswith("cpu-0")


def _one_pipeline_core(placement: dict[str, tuple[int, int]], **options: object) -> CoordinatorCore:
    flows = {("coordinator", n): 1.0 for n, (s, _) in placement.items() if s == 0}
    flows |= {(a, b): 1.0 for a in placement for b in placement if placement[a][1] == placement[b][0]}
    flows |= {(n, "coordinator"): 1.0 for n, (_, e) in placement.items() if e == 30}
    return joined_core(demo_router(1e9, placement=placement, flows=flows), **options)


def test_each_token_sends_the_next_step_to_the_first_stage_until_max_tokens() -> None:
    core = _one_pipeline_core({"cpu-1": (0, 16), "cpu-2": (16, 30)})
    core.add_request(request("r", max_tokens=3), now=0.0)
    (node, admit), = admits(core.schedule(0.0))
    assert node == "cpu-1" and [s.stage.node for s in admit.pipeline] == ["cpu-1", "cpu-2"]
    for step, token in enumerate((5, 6)):
        core.update_from_output([tokens("cpu-2", "r.1", token, step=step)], now=0.1)
        out = core.schedule(0.1)
        assert [(n, m.token_id, m.step) for n, m in of_type(out, wire.Step)] == [("cpu-1", token, step)]
        assert [o.token_ids for o in out.outputs] == [(token,)]
    core.update_from_output([tokens("cpu-2", "r.1", 7, step=2)], now=0.2)  # the core stops at max_tokens
    out = core.schedule(0.2)
    assert not of_type(out, wire.Step)
    assert sorted(n for n, _ in of_type(out, wire.Cancel)) == ["cpu-1", "cpu-2"]
    assert out.outputs[-1].finish is not None and out.outputs[-1].finish.reason is FinishReason.LENGTH
    assert not core.requests and not core.router.pipelines


def test_a_one_stage_pipeline_feeds_itself_and_the_stage_that_finished_is_not_cancelled() -> None:
    core = _one_pipeline_core({"cpu-0": (0, 30)})
    core.add_request(request("r", max_tokens=5), now=0.0)
    (_, admit), = admits(core.schedule(0.0))
    assert not admit.sampling.paced  # no stop string: nothing for the core to decide between tokens
    core.update_from_output([tokens("cpu-0", "r.1", 5)], now=0.1)
    assert not core.schedule(0.1).messages  # the agent loops its own token back
    core.update_from_output([tokens("cpu-0", "r.1", 6, step=1, finished=True, reason="stop")], now=0.2)
    out = core.schedule(0.2)
    assert not out.messages and out.outputs[-1].finish is not None
    assert out.outputs[-1].finish.reason is FinishReason.STOP


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(ensure_tokenizer_dir(None))


@pytest.mark.parametrize("placement", [{"cpu-1": (0, 16), "cpu-2": (16, 30)}, {"cpu-0": (0, 30)}],
                         ids=["two stages", "one stage"])
def test_nothing_runs_after_a_stop_string(tokenizer: ChatTokenizer, placement: dict[str, tuple[int, int]]) -> None:
    """Each token's next STEP waits for the core, which sees the stop string; a one-stage pipeline too
    (the request is paced: its agent does not feed its own token back), and its stage is cancelled."""
    first, last = min(placement, key=lambda n: placement[n][0]), max(placement, key=lambda n: placement[n][1])
    core = _one_pipeline_core(placement, stop_token_ids=tokenizer.eos_token_ids)
    core.add_request(request("r", [1, 2], max_tokens=50, stop=("lo w",), detok=IncrementalDetokenizer(tokenizer)),
                     now=0.0)  # fmt: skip
    (_, admit), = admits(core.schedule(0.0))
    assert admit.sampling.paced
    text, steps, finish = "", 0, None
    for i, token in enumerate(tokenizer.encode("hello world and more")):
        if finish is not None:
            break
        core.update_from_output([tokens(last, "r.1", token, step=i)], now=0.1)
        out = core.schedule(0.1)
        assert [(n, m.token_id, m.step) for n, m in of_type(out, wire.Step)] in ([], [(first, token, i)])
        steps += len(of_type(out, wire.Step))
        text += "".join(o.text for o in out.outputs)
        finish = out.outputs[-1].finish
    assert text == "hel" and finish is not None and finish.reason is FinishReason.STOP
    assert steps == finish.completion_tokens - 1  # no STEP after the token that completed the stop string
    assert sorted(n for n, _ in of_type(out, wire.Cancel)) == sorted(placement)  # the waiting stages too


def test_a_stop_token_ends_the_request_and_is_not_streamed(tokenizer: ChatTokenizer) -> None:
    core = _one_pipeline_core({"cpu-1": (0, 16), "cpu-2": (16, 30)}, stop_token_ids=tokenizer.eos_token_ids)
    core.add_request(request("r", [1, 2], max_tokens=50, detok=IncrementalDetokenizer(tokenizer)), now=0.0)
    core.schedule(0.0)
    text = ""
    for i, token in enumerate([*tokenizer.encode("ok"), min(tokenizer.eos_token_ids)]):
        core.update_from_output([tokens("cpu-2", "r.1", token, step=i)], now=0.1)
        out = core.schedule(0.1)
        text += "".join(o.text for o in out.outputs)
    assert text == "ok" and out.outputs[-1].finish is not None and not of_type(out, wire.Step)


def test_a_dead_agent_moves_its_requests_to_new_pipelines_with_their_tokens_so_far() -> None:
    core = joined_core(demo_router(1e9))
    for rid in ("a", "b"):
        core.add_request(request(rid, [1, 2, 3], max_tokens=10), now=0.0)
    first = {a.request_id[0]: a for _, a in admits(core.schedule(0.0))}
    on_split = next(rid for rid, a in first.items() if len(a.pipeline) == 2)
    core.update_from_output([tokens("cpu-2", f"{on_split}.1", 9)], now=0.1)
    core.schedule(0.1)
    core.update_from_output([AgentDied("cpu-2")], now=0.2)
    out = core.schedule(0.2)
    (node, again), = admits(out)
    assert again.request_id == f"{on_split}.2" and again.prompt == (1, 2, 3, 9) and again.max_tokens == 9
    assert node == again.pipeline[0].stage.node and "cpu-2" not in [s.stage.node for s in again.pipeline]
    assert [(n, m.request_id) for n, m in of_type(out, wire.Cancel)] == [("cpu-1", f"{on_split}.1")]
    core.update_from_output([tokens("cpu-2", f"{on_split}.1", 77)], now=0.3)  # late token of the dead attempt
    assert not core.schedule(0.3).outputs and core.requests[on_split].output_ids == [9]


def test_refusals_end_the_request_with_the_stage_and_its_reason() -> None:
    core = _one_pipeline_core({"cpu-1": (0, 16), "cpu-2": (16, 30)})
    core.add_request(request("r"), now=0.0)
    core.schedule(0.0)
    core.update_from_output([wire.Refused("r.1", "cpu-2", "capacity", "needs 741 KV tokens")], now=0.1)
    out = core.schedule(0.1)
    (o,) = out.outputs
    assert isinstance(o.error, CapacityError) and o.code is ErrorCode.CAPACITY and o.node == "cpu-2"
    assert "needs 741 KV tokens" in o.error.message and not core.requests


def test_an_unreachable_stage_is_masked_and_the_request_moves() -> None:
    core = joined_core(demo_router(1e9))
    core.add_request(request("r"), now=0.0)
    (node, admit), = admits(core.schedule(0.0))
    core.update_from_output([Unreachable(node, admit.request_id)], now=0.1)
    (node2, again), = admits(core.schedule(0.1))
    assert node in core.router.dead and node2 != node and again.request_id == "r.2"


def test_a_request_is_given_up_after_max_attempts() -> None:
    core = joined_core(demo_router(1e9), max_attempts=2)
    core.add_request(request("r"), now=0.0)
    core.schedule(0.0)
    for attempt in (1, 2):
        core.update_from_output([wire.Refused(f"r.{attempt}", "cpu-0", "unreachable", "gone")], now=0.1)
        out = core.schedule(0.1)
    assert isinstance(out.outputs[-1].error, NoRouteError) and "after 2 pipelines" in out.outputs[-1].error.message


def test_abort_cancels_everywhere_and_frees_the_reservation() -> None:
    core = _one_pipeline_core({"cpu-1": (0, 16), "cpu-2": (16, 30)})
    core.add_request(request("r"), now=0.0)
    core.schedule(0.0)
    core.abort_request("r")
    out = core.schedule(0.1)
    assert sorted(n for n, _ in of_type(out, wire.Cancel)) == ["cpu-1", "cpu-2"] and not out.outputs
    assert not core.requests and not core.router.pipelines and core.running == 0


def test_when_the_last_route_dies_waiting_requests_fail_with_no_route() -> None:
    core = joined_core(demo_router(FITS_ONE))
    for rid in "abc":
        core.add_request(request(rid), now=0.0)
    core.schedule(0.0)
    core.update_from_output([AgentDied("cpu-0"), AgentDied("cpu-1")], now=0.1)
    out = core.schedule(0.1)
    assert sorted(o.request_id for o in out.outputs if isinstance(o.error, NoRouteError)) == ["a", "b", "c"]
    assert not core.requests and not core.waiting and DEMO_PLACEMENT.keys() >= core.router.dead


def test_with_live_re_planning_requests_wait_through_an_outage_for_the_new_plan() -> None:
    core = joined_core(demo_router(1e9), admission_timeout_s=20)
    core.wait_for_replan = True
    core.add_request(request("a", [1, 2, 3], max_tokens=10), now=0.0)
    (_, admit), = admits(core.schedule(0.0))
    core.update_from_output([tokens(last_node(admit), "a.1", 9)], now=0.1)
    core.schedule(0.1)
    core.update_from_output([AgentDied("cpu-0"), AgentDied("cpu-1")], now=0.2)  # no route is left
    assert not core.ready and not core.schedule(0.2).outputs  # a, in flight, waits: not failed
    core.add_request(request("b"), now=0.3)  # so does a new request (no 503 while a re-plan can help)
    assert [r.request_id for r in core.waiting] == ["a", "b"] and not core.schedule(5.0).messages

    survivor = demo_router(1e9, placement={"cpu-2": (0, 30)}, flows={("coordinator", "cpu-2"): 1.0,
                                                                       ("cpu-2", "coordinator"): 1.0})
    core.set_router(survivor)  # the re-plan is routed: cpu-2 now holds every layer
    core.update_from_output([AgentJoined("cpu-2", welcome("cpu-2", (0, 30)))], now=6.0)
    out = core.schedule(6.0)
    started = {a.request_id.split(".")[0]: a for _, a in admits(out)}
    assert set(started) == {"a", "b"} and started["a"].prompt == (1, 2, 3, 9)  # a re-prefilled, its token kept
    assert all(s.stage.node == "cpu-2" for a in started.values() for s in a.pipeline)
    assert not [o for o in out.outputs if o.error is not None]


def test_waiting_for_a_re_plan_ends_when_the_membership_says_the_model_cannot_be_served() -> None:
    core = joined_core(demo_router(1e9), admission_timeout_s=20)
    core.wait_for_replan = True
    core.add_request(request("a"), now=0.0)
    core.schedule(0.0)
    core.update_from_output([AgentDied("cpu-0"), AgentDied("cpu-1")], now=0.1)
    core.add_request(request("b"), now=0.2)
    assert [r.request_id for r in core.waiting] == ["a", "b"]
    core.set_unavailable("the 1 node(s) left cannot serve the model: layers [0, 16) are held by no node")
    out = core.schedule(0.3)
    failed = {o.request_id: o.error for o in out.outputs}
    assert set(failed) == {"a", "b"} and all(isinstance(e, NoRouteError) and "cannot serve the model" in str(e)
                                             for e in failed.values())  # fmt: skip
    with pytest.raises(NoRouteError, match="cannot serve the model"):  # and new requests are refused at once
        core.add_request(request("c"), now=0.4)
    assert not core.requests and not core.waiting


def test_a_request_waiting_for_a_re_plan_still_times_out() -> None:
    core = joined_core(demo_router(1e9), admission_timeout_s=5)
    core.wait_for_replan = True
    core.update_from_output([AgentDied("cpu-0"), AgentDied("cpu-1")], now=0.0)
    core.add_request(request("a"), now=1.0)
    assert not core.schedule(5.9).outputs
    (out,) = core.schedule(6.0).outputs
    assert out.request_id == "a" and isinstance(out.error, OverloadedError) and not core.waiting
