"""The serving model prices what the simulator prices (issue 21) and the serving objective scores a
placement under the flows the paper's simulator recomputes as well as under its balanced flows."""

from __future__ import annotations

import dataclasses

import pytest

from helix.perf_model import host_copy_s_per_byte, prompts_per_iteration
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.capacity import CapacityModel
from planner.flows import balanced_flows, judge_flows
from planner.graph import max_flow_value
from planner.local_search import Evaluator
from planner.serving_model import ServingModel
from planner.serving_workload import Workload

# single24's default plan before issue 21's step 3: T4 triplets where the max flow needs two of three
TRIPLETS = {"a100-6": (0, 10), "a100-9": (10, 20), "a100-10": (20, 30), "a100-17": (30, 40),
            "l4-0": (40, 46), "l4-3": (40, 46), "l4-11": (46, 52), "l4-5": (46, 52), "l4-14": (52, 58),
            "l4-18": (52, 58), "l4-21": (58, 64), "l4-23": (58, 64), "t4-1": (64, 68), "t4-16": (64, 68),
            "t4-2": (64, 68), "t4-19": (68, 72), "t4-4": (68, 72), "t4-7": (68, 72), "t4-12": (72, 76),
            "t4-20": (72, 76), "t4-8": (72, 76), "t4-13": (76, 80), "t4-15": (76, 80), "t4-22": (76, 80)}


def estimate(cap: CapacityModel, placement: dict[str, tuple[int, int]], workload: Workload | None = None, *,
             judge: bool = False) -> float:
    value, edges = balanced_flows(cap, placement)
    flows = judge_flows(cap, placement) if judge else {(e.src, e.dst): e.tok_s for e in edges}
    return ServingModel(cap, workload).estimate(placement, flows, value).decode_tok_s


def test_the_paper_vllm_limits_and_copy_rates() -> None:
    assert [prompts_per_iteration(t) for t in (6144, 2048, 4096, 1000)] == [3, 1, 2, 1]
    assert prompts_per_iteration(6144, None) is None
    # a 763-token prompt's LLaMA-2 70B activations (16384 B per token) copied at 4 then 5 GB/s: 5.63 ms
    assert 763 * 16384 * host_copy_s_per_byte() == pytest.approx(0.005626, abs=1e-6)
    assert host_copy_s_per_byte(()) == 0.0


def test_prompt_tokens_one_iteration_carries(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    model = ServingModel(CapacityModel.build(*single24))
    # A100: 3 whole prompts (6144 // 2048) of the mean 763 tokens; L4 and T4: one (2048 // 2048)
    assert model.prompt_tokens_per_iteration("a100-6", 10) == pytest.approx(3 * 763)
    assert model.prompt_tokens_per_iteration("l4-0", 6) == pytest.approx(763)
    assert model.prompt_tokens_per_iteration("t4-1", 4) == pytest.approx(763)
    free = ServingModel(CapacityModel.build(*single24), Workload(prompt_slot_tokens=None))
    assert free.prompt_tokens_per_iteration("l4-0", 6) == pytest.approx(2048)  # only the token limit


def test_a_batch_whose_riding_prompts_exceed_one_prompt_runs_them_apart(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cap = CapacityModel.build(*single24)
    limited, free = ServingModel(cap), ServingModel(cap, Workload(prompt_slot_tokens=None))
    # 300 decodes (one step: the L4 decodes up to 380) carry 300 x 763 / 232 = 987 prompt tokens: within the
    # L4's 2048 tokens, over its one prompt; the rest runs in a prompt-only iteration of its own
    curves = cap.kinds["L4"].curves
    assert curves is not None
    context = 300 * (763 + 232 / 2)
    decodes = curves.iteration_ms(((6, 0, 300, context),), sampled=300)
    prompt = 6 * curves.prefill.at(763)  # a riding prompt costs what the simulator prices a whole prompt at
    riding = 300 * 763 / 232
    rest = (riding - 763) / 763 * curves.iteration_ms(((6, 763, 0, 0),), sampled=1)
    assert limited.decode_s("l4-0", 6, 300.0) == pytest.approx((decodes + prompt + rest) / 1000)
    assert free.decode_s("l4-0", 6, 300.0) == pytest.approx((decodes + riding / 763 * prompt) / 1000)


def test_host_copy_is_priced_per_stage(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cap = CapacityModel.build(*single24)
    model = ServingModel(cap)
    assert model.copy_s(763, first=False) == pytest.approx(0.005626, abs=1e-6)  # activations from a node
    assert model.copy_s(763, first=True) == pytest.approx(763 * 2 * host_copy_s_per_byte())  # token ids
    # a decode step: its decodes' tokens and the prompt tokens riding along are copied before it runs
    step = model.step_s("l4-0", 6, 20.0, False, False, False)
    riding = 20 * 763 / 232
    assert step - model.decode_s("l4-0", 6, 20.0) == pytest.approx(model.copy_s(20 + riding, first=False))
    # a node holding the whole model feeds its decodes' tokens back to itself: only the riding ids
    alone = model.step_s("a100-6", 1, 20.0, True, True, True)
    assert alone - model.decode_s("a100-6", 1, 20.0, True) == pytest.approx(model.copy_s(riding, first=True))
    free = Workload(host_copy_gb_per_s=())
    assert estimate(cap, TRIPLETS, free) > estimate(cap, TRIPLETS)  # 12 stages of copies cost throughput


def test_judge_flows_idle_a_slack_node_and_the_objective_scores_the_mean_estimate(
        single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cap = CapacityModel.build(*single24)
    flows = judge_flows(cap, TRIPLETS)
    used = {dst for (_, dst) in flows}
    idle = [n for n in TRIPLETS if n not in used]
    assert idle and all(n.startswith("t4") for n in idle)  # the max flow needs two T4s of a triplet
    balanced, judged = estimate(cap, TRIPLETS), estimate(cap, TRIPLETS, judge=True)
    assert judged < 0.95 * balanced  # fewer nodes carry the same requests: bigger batches, longer waits
    scored = Evaluator(cap, "serving", serving_model=ServingModel(cap)).score(dict(TRIPLETS))
    assert scored.serving is not None and scored.judged is not None
    assert scored.key[0] == pytest.approx(round((judged + balanced) / 2, 3), abs=1e-3)
    assert scored.key[1] == pytest.approx(round(balanced, 3))
    plain = Evaluator(cap, "serving", serving_model=ServingModel(cap), judge_flows=False).score(dict(TRIPLETS))
    assert plain.judged is None and plain.key[0] == pytest.approx(round(balanced, 3))


def test_requests_in_flight_follow_the_feeder_and_the_router_mask(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cap = CapacityModel.build(*single24)
    model = ServingModel(cap)
    value, edges = balanced_flows(cap, TRIPLETS)
    est = model.estimate(TRIPLETS, {(e.src, e.dst): e.tok_s for e in edges}, value)
    # the A100 chain is the fullest layer: 10 layers each, 1 holder per layer, (763 + 232) tokens per request
    a100 = cap.kinds["A100"].kv_entries[9] / 10
    assert est.requests_in_flight == pytest.approx(0.8 * a100 / (763 + 232), rel=0.01)
    assert est.binding == "kv"
    # a node's own limit is the router's 0.85; the feeder's 0.8 is on a layer summed over its holders
    looser = ServingModel(cap, dataclasses.replace(Workload(), kv_watermark=0.85)).estimate(
        TRIPLETS, {(e.src, e.dst): e.tok_s for e in edges}, value)
    assert looser.requests_in_flight == pytest.approx(0.85 * a100 / (763 + 232), rel=0.01)
    assert max_flow_value(cap, TRIPLETS) == pytest.approx(value, rel=1e-6)
