"""Which nodes hold which task, end to end (issue 19 part 2): the ``openai`` client -> HTTP ->
coordinator -> three ``helix agent`` processes (tests/router/conftest.py: cpu-0 [0, 30), cpu-1
[0, 16), cpu-2 [16, 30)).

One random LoRA is loaded three times under three names: on every node (the default), on cpu-1
and cpu-2 only (``"nodes"`` in the load body), and on cpu-1 only. The second answers exactly as
the first and only through cpu-1 -> cpu-2; the third has no complete pipeline: a 503 naming it,
never an answer by the bare base model.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.router.pet_tasks import (
    ATTENTION,
    MODEL,
    ServingCluster,
    complete,
    load,
    random_lora,
    smollm2_hf,
    unload,
)

NAMES = {"placed-all": None, "placed-split": ["cpu-1", "cpu-2"], "placed-cpu-1": ["cpu-1"]}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from node_agent.task_files import save_pet

    return save_pet(tmp_path_factory.mktemp("placed") / "lora", "lora", random_lora(smollm2_hf(), 81, 8, ATTENTION))


def test_a_task_is_served_only_through_the_nodes_holding_it_and_without_them_is_a_503_naming_it(
        serving_cluster: ServingCluster, task_dir: Path) -> None:  # fmt: skip
    cluster = serving_cluster
    try:
        for name, nodes in NAMES.items():
            response = load(cluster, name, task_dir, **({"nodes": nodes} if nodes else {}))
            assert response.status_code == 200, response.text
        placement = cluster.coordinator.router.task_nodes
        assert placement.holders("placed-all") is None and placement.holders("placed-split") == {"cpu-1", "cpu-2"}
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        base = complete(cluster, MODEL, prompt).choices[0].text
        everywhere = complete(cluster, "placed-all", prompt).choices[0].text
        assert everywhere != base
        for _ in range(3):  # IWRR would send some through cpu-0: the mask keeps them on the task's holders
            out = complete(cluster, "placed-split", prompt)
            assert out.choices[0].text == everywhere
            assert [s["node"] for s in out.model_extra["helix"]["pipelines"][0]] == ["cpu-1", "cpu-2"]
        with pytest.raises(openai.APIStatusError, match=r"task 'placed-cpu-1' has no route.*layers \[16, 30\)") as exc:
            complete(cluster, "placed-cpu-1", prompt)
        assert exc.value.status_code == 503
        with cluster.http() as http:
            refused = http.post("/v1/load_lora_adapter", json={"lora_name": "placed-x", "lora_path": str(task_dir),
                                                                "nodes": ["cpu-9"]})  # fmt: skip
        assert refused.status_code == 400 and "cpu-9" in refused.text
    finally:
        for name in NAMES:
            unload(cluster, name)
    assert not cluster.coordinator.router.task_nodes.restricted()
