"""Many fine-tuned tasks on one base, batched together through three agents over ZeroMQ and HTTP.

Issue 16's "a mixed batch equals each task alone" and "runtime load/unload under streaming load
loses no request". The test cluster (tests/router/conftest.py: SmolLM2-135M, cpu-0 [0, 30),
cpu-1 [0, 16), cpu-2 [16, 30)) runs every agent with a prefill chunk of :data:`CHUNK` tokens, so
the prompts here, longer than that, are prefilled in chunks (checked on the agents' step counts).
Sixteen random tasks (:data:`MIXED`: four LoRAs, three of each other PET type; some of a few
layers or modules only, so an agent may hold nothing of a task) are loaded at runtime. Every
request is compared with the text its task gives served alone, and the tasks give different texts
on the same prompt, so an answer by the wrong task would show.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from router.tasks import TaskState
from tests.router.pet_tasks import (
    ATTENTION,
    MAX_LORA_RANK,
    MLP,
    MODEL,
    ServingCluster,
    complete,
    layer_of,
    load,
    only,
    peft_lora,
    random_adapter,
    random_bitfit,
    random_diff,
    random_lora,
    random_mask_complement,
    smollm2_hf,
    unload,
)

CHUNK = 16  # every agent's --chunk-size
NEW = 8  # tokens per request
WAVE = 8  # streaming requests started together
# the base and sixteen tasks, the PET types interleaved
MIXED = [MODEL, "lora-peft", "adapter-relu", "bitfit", "diff", "mask", "lora-attn", "adapter-gelu", "bitfit-no-head",
         "diff-sparser", "mask-lighter", "lora-mlp", "adapter-mlp-silu", "bitfit-upper", "diff-lower", "mask-8-24",
         "lora-qv-10-20"]  # fmt: skip
STEADY = [MODEL, "lora-peft", "adapter-gelu", "bitfit-upper", "diff-lower", "mask"]  # served throughout the churn
CHURN = ["churn-lora", "churn-bitfit", "churn-mask"]  # loaded and unloaded under load
VICTIM, VICTIM_TOKENS = "victim-adapter", 24  # unloaded with a request of this many tokens in flight


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path,
            cluster_server: Any) -> Iterator[ServingCluster]:  # fmt: skip
    for serving in cluster_server(tmp_path_factory, demo_cluster, agent_args=("--chunk-size", str(CHUNK))):
        serving.coordinator.tasks.max_lora_rank = MAX_LORA_RANK
        yield serving


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random prompts; the seeds used here are ones on which every task gives its own greedy text."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    return random_prompts(33, (35, 50))


def _layers(lo: int, hi: int) -> Callable[[str], bool]:
    """Tensors of layers ``[lo, hi)``; the final norm's and the LM head's count as past the last layer."""
    return lambda name: lo <= (30 if (layer := layer_of(name)) is None else layer) < hi


@pytest.fixture(scope="module")
def task_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tasks(tmp_path_factory.mktemp("mixed-tasks"))


def write_tasks(root: Path) -> dict[str, Path]:
    """Every task's directory under ``root``: :data:`MIXED`'s, :data:`CHURN`'s and :data:`VICTIM`'s."""
    from node_agent.task_files import save_pet

    hf = smollm2_hf()
    peft_lora(hf, root / "lora-peft", rank=8, seed=21)
    qv = ("self_attn.q_proj", "self_attn.v_proj")
    pets: dict[str, tuple[str, dict[str, torch.Tensor], dict[str, Any]]] = {
        "lora-attn": ("lora", random_lora(hf, 22, 4, ATTENTION), {"lora_scaling": 2.0}),
        "lora-mlp": ("lora", random_lora(hf, 23, 16, MLP), {}),
        "lora-qv-10-20": ("lora", only(random_lora(hf, 24, 8, qv), _layers(10, 20)), {}),  # across cpu-1 | cpu-2
        "adapter-relu": ("adapter", random_adapter(hf, 31, 16), {}),
        "adapter-gelu": ("adapter", random_adapter(hf, 32, 8), {"adapter_activation": "gelu"}),
        "adapter-mlp-silu": ("adapter", only(random_adapter(hf, 33, 32), lambda n: "mlp_adapter" in n),
                             {"adapter_activation": "silu"}),
        "bitfit": ("bitfit", random_bitfit(hf, 41), {}),
        "bitfit-no-head": ("bitfit", only(random_bitfit(hf, 42), _layers(0, 30)), {}),
        "bitfit-upper": ("bitfit", only(random_bitfit(hf, 43), _layers(16, 31)), {}),  # nothing on cpu-1
        "diff": ("diff", random_diff(hf, 51), {}),
        "diff-sparser": ("diff", random_diff(hf, 52, density=0.002), {}),
        "diff-lower": ("diff", only(random_diff(hf, 53), _layers(0, 16)), {}),  # nothing on cpu-2
        "mask": ("mask", random_mask_complement(hf, 61), {}),
        "mask-lighter": ("mask", random_mask_complement(hf, 62, zeroed=0.02), {}),
        "mask-8-24": ("mask", only(random_mask_complement(hf, 63), _layers(8, 24)), {}),
        "churn-lora": ("lora", random_lora(hf, 71, 8, ATTENTION), {}),
        "churn-bitfit": ("bitfit", random_bitfit(hf, 72), {}),
        "churn-mask": ("mask", random_mask_complement(hf, 73), {}),
        VICTIM: ("adapter", random_adapter(hf, 74, 16), {}),
    }
    dirs = {name: save_pet(root / name, kind, tensors, **kw) for name, (kind, tensors, kw) in pets.items()}
    return {"lora-peft": root / "lora-peft", **dirs}


@pytest.fixture(scope="module")
def mixed_tasks(cluster: ServingCluster, task_dirs: dict[str, Path]) -> list[str]:
    """:data:`MIXED`'s tasks, loaded at runtime."""
    for name in MIXED[1:]:
        response = load(cluster, name, task_dirs[name])
        assert response.status_code == 200, response.text
    return MIXED[1:]


def _stream(cluster: ServingCluster, model: str, prompt: list[int], max_tokens: int = NEW) -> Iterator[Any]:
    return iter(cluster.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                    stream=True))  # fmt: skip


def _until_first_token(stream: Iterator[Any]) -> list[str]:
    """The stream's texts up to its first token's (its first chunk, the pipeline's, has no text)."""
    parts: list[str] = []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            if parts[-1] or chunk.choices[0].finish_reason:
                break
    return parts


def _node_steps(cluster: ServingCluster, metric: str) -> dict[str, tuple[dict[float, float], float]]:
    """Per node, an agents' step histogram of /metrics (``helix_node_batch_tokens``...): its
    cumulative step counts by bucket bound and the sum of the values."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    out: dict[str, tuple[dict[float, float], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != metric:
            continue
        for s in family.samples:
            counts, total = out.get(s.labels["node"], ({}, 0.0))
            if s.name.endswith("_bucket"):
                counts[float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                total = s.value
            out[s.labels["node"]] = (counts, total)
    return out


def _steps_since(before: dict[str, tuple[dict[float, float], float]],
                 now: dict[str, tuple[dict[float, float], float]]) -> dict[str, tuple[dict[float, float], float]]:  # fmt: skip
    empty: tuple[dict[float, float], float] = ({}, 0.0)
    return {node: ({le: c - before.get(node, empty)[0].get(le, 0.0) for le, c in counts.items()},
                   total - before.get(node, empty)[1]) for node, (counts, total) in now.items()}  # fmt: skip


def test_32_requests_over_16_tasks_of_every_pet_type_and_the_base_joining_mid_flight_equal_each_alone(
        cluster: ServingCluster, mixed_tasks: list[str], long_prompts: list[list[int]]) -> None:  # fmt: skip
    """32 streaming requests over the sixteen tasks and the base, in waves of :data:`WAVE` started
    together, each wave once the one before it streamed its first tokens (so the agents' steps mix
    tasks, prefill chunks and decodes), give exactly the text each gives served alone."""
    requests = [(name, 0) for name in MIXED] + [(name, 1) for name in MIXED[:15]]
    kinds = {cluster.coordinator.tasks.tasks[name].pet_type for name in mixed_tasks}
    assert len(requests) == 32 and len(mixed_tasks) == 16 and kinds == {"lora", "adapter", "bitfit", "diff", "mask"}

    # chunked prefill: a prompt alone goes through every stage of its pipeline in steps of at most CHUNK tokens
    prompt, before = long_prompts[1], _node_steps(cluster, "helix_node_batch_tokens")
    out = complete(cluster, MODEL, prompt, max_tokens=1)
    stages = [s["node"] for s in out.model_extra["helix"]["pipelines"][0]]
    cluster.wait_until(lambda: all(_steps_since(before, _node_steps(cluster, "helix_node_batch_tokens"))[node][1]
                                   >= len(prompt) for node in stages), 10, "the agents' step counts")  # fmt: skip
    for node, (counts, tokens) in _steps_since(before, _node_steps(cluster, "helix_node_batch_tokens")).items():
        if node not in stages:
            assert tokens == 0, node
            continue
        assert tokens == len(prompt), node
        assert counts[CHUNK] == counts[math.inf] >= math.ceil(len(prompt) / CHUNK), (node, counts)

    alone = [complete(cluster, name, long_prompts[k], max_tokens=NEW).choices[0].text for name, k in requests]
    for k in (0, 1):  # every task gives its own text on the same prompt
        texts = [text for (_, kk), text in zip(requests, alone, strict=True) if kk == k]
        assert len(set(texts)) == len(texts), texts

    before = _node_steps(cluster, "helix_node_batch_sequences")
    streams, texts = [], []
    for wave in range(0, len(requests), WAVE):  # a wave joins while the one before it decodes
        streams += [_stream(cluster, name, long_prompts[k]) for name, k in requests[wave:wave + WAVE]]
        texts += [_until_first_token(stream) for stream in streams[wave:]]
    for stream, parts in zip(streams, texts, strict=True):
        parts += [c.choices[0].text for c in stream if c.choices]
    assert ["".join(parts) for parts in texts] == alone

    def batched_steps() -> float:  # steps that ran three requests or more
        return sum(c[math.inf] - c[2.0] for c, _ in _steps_since(before, _node_steps(
            cluster, "helix_node_batch_sequences")).values())  # fmt: skip

    cluster.wait_until(lambda: batched_steps() > 0, 10, "a step that batched three requests")


def test_tasks_loaded_and_unloaded_under_streaming_load_lose_no_request(
        cluster: ServingCluster, mixed_tasks: list[str], task_dirs: dict[str, Path]) -> None:  # fmt: skip
    """Eight clients stream requests over six served tasks (the base among them) all along, while
    three other tasks are loaded, used and unloaded three times, and a fourth is unloaded with its
    request in flight (which finishes first): every request gives the text its task gives alone,
    none fails, and no task is left behind."""
    prompts = random_prompts(7, (24, 30))
    for name in (*CHURN, VICTIM):
        assert load(cluster, name, task_dirs[name]).status_code == 200
    names = [*STEADY, *CHURN, VICTIM]
    alone = {(name, k): complete(cluster, name, prompts[k], max_tokens=NEW).choices[0].text
             for name in names for k in (0, 1)}  # fmt: skip
    victim_alone = complete(cluster, VICTIM, prompts[1], max_tokens=VICTIM_TOKENS).choices[0].text
    for name in CHURN:
        assert unload(cluster, name).status_code == 200
    for k in (0, 1):  # an answer by the wrong task would show
        assert len({alone[name, k] for name in names}) == len(names), alone

    done: list[tuple[str, int, str, set[str]]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        n, name = 0, ""
        try:
            while n < 2 or not stop.is_set():
                name, k = STEADY[(i + n) % len(STEADY)], n % 2
                chunks = list(_stream(cluster, name, prompts[k]))
                done.append((name, k, "".join(c.choices[0].text for c in chunks if c.choices),
                             {c.model for c in chunks}))  # fmt: skip
                n += 1
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            errors.append(f"client {i}, {name}: {exc!r}")

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        cluster.wait_until(lambda: len(done) >= len(threads), 120, "the clients to stream")
        streamed_before = len(done)
        for cycle in range(3):
            for name in CHURN:
                response = load(cluster, name, task_dirs[name])
                assert response.status_code == 200, response.text
            streams = {name: _stream(cluster, name, prompts[cycle % 2]) for name in CHURN}  # served, together
            for name, stream in streams.items():
                assert "".join(c.choices[0].text for c in stream if c.choices) == alone[name, cycle % 2], name
            for name in CHURN:
                assert unload(cluster, name).status_code == 200
            with pytest.raises(openai.NotFoundError):
                complete(cluster, CHURN[cycle], prompts[0])

        stream = _stream(cluster, VICTIM, prompts[1], max_tokens=VICTIM_TOKENS)
        parts = _until_first_token(stream)
        unloaded: list[Any] = []
        unloader = threading.Thread(target=lambda: unloaded.append(unload(cluster, VICTIM)))
        unloader.start()
        victim = cluster.coordinator.tasks.tasks[VICTIM]
        cluster.wait_until(lambda: victim.state is TaskState.UNLOADING, 30, "the unload to start")
        assert victim.in_flight == 1  # its request is still running
        with pytest.raises(openai.NotFoundError, match=VICTIM):
            complete(cluster, VICTIM, prompts[0])
        parts += [c.choices[0].text for c in stream if c.choices]
        assert "".join(parts) == victim_alone  # the request in flight finished, whole
        unloader.join(timeout=60)
        assert unloaded and unloaded[0].status_code == 200, unloaded
        assert len(done) >= streamed_before + len(threads)  # the clients streamed all along
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    wrong = [(name, k, text) for name, k, text, models in done if text != alone[name, k] or models != {name}]
    assert not wrong, wrong
    assert sorted(cluster.coordinator.tasks.tasks) == sorted(mixed_tasks)
