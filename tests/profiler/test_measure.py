"""``helix profile --cluster``: the real engine, real ZeroMQ probes, the files it writes, the cache."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helix.cli import main as helix_main
from helix.errors import ConfigError
from helix.profile import load_profile_file, load_profiles_for
from helix.spec import load_cluster
from profiler.cluster_profile import profile_cluster
from profiler.files import ProfileCache
from profiler.links import ProbeSet
from profiler.measure import MeasureSettings

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "clusters" / "demo"
QUICK = MeasureSettings(probe_layers=1, prefill_tokens=(8, 32), decode_batches=(1, 4), context_tokens=16, repeats=1,
                        long_context_tokens=48, context_batch=2, pet_rows=(1, 8), pet_tasks=4, pet_repeats=1)


@pytest.fixture()
def demo(tmp_path: Path) -> Path:
    shutil.copytree(DEMO, tmp_path / "demo")
    return tmp_path / "demo" / "cluster.yaml"


def test_profile_demo_cluster_writes_loadable_profiles_and_links(demo: Path) -> None:
    cluster = load_cluster(demo)
    own = (demo.parent / "profiles-smollm2.yaml").read_bytes()
    result = profile_cluster(cluster, settings=QUICK)
    assert result.measured == ["cpu"] and not result.cache_hits
    assert result.profiles_path == demo.parent / "profiles-measured.yaml"  # not over the cluster's own file
    assert (demo.parent / "profiles-smollm2.yaml").read_bytes() == own
    listed = yaml.safe_load(demo.read_text()) | {"profiles": ["profiles-smollm2.yaml", "profiles-measured.yaml"]}
    demo.write_text(yaml.safe_dump(listed))
    profiles = load_profiles_for(load_cluster(demo))  # the planner's loader accepts what we wrote
    tp = profiles.throughput("cpu", cluster.model)
    assert tp.tok_s is None and tp.prefill_ms_per_layer and tp.decode_ms_per_layer
    assert [t for t, _ in tp.prefill_ms_per_layer] == [0.0, 8.0, 32.0]
    assert all(ms > 0 for t, ms in tp.prefill_ms_per_layer + tp.decode_ms_per_layer if t > 0)
    assert tp.decode_max_tokens_by_layers and len(tp.decode_max_tokens_by_layers) == 30
    # context costs: the decode curve's own context (see test_step_curves_...) and a per-token price
    assert tp.decode_context_tokens == expected_decode_context(QUICK)
    assert tp.decode_ms_per_context_token is not None and tp.decode_ms_per_context_token >= 0
    assert tp.max_layers == profiles.models[cluster.model].num_layers == 30
    # what each fine-tuned task a step touches costs a layer, per PET type (profiler.pet_costs)
    assert tp.pet_ms_per_layer is not None and set(tp.pet_ms_per_layer) == {"lora", "adapter", "bitfit", "diff", "mask"}
    assert all([rows for rows, _ in c] == [1.0, 8.0] and all(ms >= 0 for _, ms in c) for c in tp.pet_ms_per_layer.values())
    table = tp.tok_s_table(profiles.models[cluster.model])
    assert len(table) == 30 and all(t > 0 for t in table)
    links = yaml.safe_load((demo.parent / "links-measured.yaml").read_text())["links"]
    assert len(links) == 12  # coordinator + 3 nodes, every ordered pair
    assert all(link["bandwidth_gbps"] > 0 and link["latency_ms"] > 0 for link in links)
    # a rerun is served from the cache (engine and links)
    again = profile_cluster(load_cluster(demo), settings=QUICK)
    assert again.cache_hits == ["cpu"] and not again.measured
    assert [m.as_dict() for m in again.links] == [m.as_dict() for m in result.links]
    assert load_profile_file(again.profiles_path) == load_profile_file(result.profiles_path)
    forced = profile_cluster(load_cluster(demo), settings=QUICK, force=True, measure_links=False)
    assert forced.measured == ["cpu"]


def test_profiles_merge_keeps_other_entries(demo: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged.yaml"
    shutil.copy(ROOT / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml", out)
    profile_cluster(load_cluster(demo), settings=QUICK, output=out, measure_links=False)
    merged = load_profile_file(out)
    assert {"A100", "L4", "T4", "cpu"} <= set(merged.gpus)
    assert {"llama-2-70b", "smollm2-135m"} <= set(merged.models)


def test_cache_ignores_other_keys_and_corrupt_files(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    cache.put({"model": "m", "device": "d"}, {"x": 1})
    assert cache.get({"model": "m", "device": "d"}) == {"x": 1}
    assert cache.get({"model": "m", "device": "other"}) is None
    for f in tmp_path.iterdir():
        f.write_text("{not json")
    assert cache.get({"model": "m", "device": "d"}) is None


def expected_decode_context(s: MeasureSettings) -> float:
    """The decode curve's context by :func:`profiler.measure._step_curves`' rule, worked out here
    on its own: a pool of ``max(decode_batches)`` requests at ``context_tokens``; every round each
    batch takes the next ``b`` of them in turn (each step adds a token to those it ran); the
    untimed first round is not counted; + 1 for the token each step adds."""
    contexts = [s.context_tokens] * max(s.decode_batches)
    turn, total, count = 0, 0, 0
    for rnd in range(s.repeats + 1):
        for b in s.decode_batches:
            picked = [(turn + j) % len(contexts) for j in range(b)]
            if rnd > 0:
                total += sum(contexts[i] for i in picked)
                count += b
            for i in picked:
                contexts[i] += 1
            turn = (turn + b) % len(contexts)
    return round(total / count + 1, 2)


def test_step_curves_measure_every_point_in_turns_on_resident_requests() -> None:
    from node_agent.engine import StageEngine
    from node_agent.gguf_convert import cached_model_dir
    from node_agent.scheduler import SchedulerConfig
    from profiler.measure import _step_curves

    s = MeasureSettings(prefill_tokens=(8, 16), decode_batches=(1, 2, 4), context_tokens=12, long_context_tokens=40,
                        context_batch=2, repeats=3)  # fmt: skip
    sched = SchedulerConfig(max_batch_size=16, token_budget=64, chunk_size=None)
    engines = {name: StageEngine(cached_model_dir(), 1, 2, kv_capacity_tokens=4096, scheduler=sched)
               for name in ("a", "b")}  # fmt: skip
    notes: list[str] = []
    curves = _step_curves(engines, s, notes.append, context_labels=("b",))
    assert notes[-1] == f"round {s.repeats + 1} of {s.repeats + 1}: prefill, decode, context"
    for name, c in curves.items():
        assert len(c.prefill) == 2 and len(c.decode) == 3 and all(ms > 0 for ms in c.prefill + c.decode)
        assert round(c.decode_context_tokens + 1, 2) == expected_decode_context(s)
        assert not engines[name].has_unfinished  # every probe request is gone
    assert curves["a"].context == [] and curves["a"].context_growth_ms == 0.0
    assert len(curves["b"].context) == 2 and all(ms > 0 for ms in curves["b"].context)


def test_link_probe_measures_loopback() -> None:
    with ProbeSet({"a": "127.0.0.1", "b": "localhost"}) as probes:
        m = probes.measure("a", "b", pings=3, bulk_bytes=1 << 20, chunk_bytes=1 << 18)
    assert m.src == "a" and m.dst == "b" and m.bandwidth_gbps > 0 and m.latency_ms > 0


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().err.split())


def test_bad_inputs_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: smollm2-135m\nprofiles: p.yaml\nnodes: [{id: a, gpu: cpu, colour: red}]\n")
    assert helix_main(["profile", "--cluster", str(bad)]) == 2
    assert "nodes[0].colour: unknown field" in _err(capsys)
    assert helix_main(["profile", "--estimate", "--gpus", "A100,B200", "--model", "llama-2-70b"]) == 2
    assert "unknown GPU 'B200'" in _err(capsys)
    assert helix_main(["profile"]) == 2
    assert "--cluster" in _err(capsys)
    assert helix_main(["profile", "--cluster", str(tmp_path / "missing.yaml")]) == 2
    assert "file not found" in _err(capsys)


def test_unknown_model_needs_model_dir(tmp_path: Path) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: x\nmodel: llama-2-70b\nprofiles: p.yaml\nnodes: [{id: a, gpu: cpu}]\n"
                       "links: [{src: coordinator, dst: a, bandwidth_gbps: 1, bidirectional: true}]\n")  # fmt: skip
    with pytest.raises(ConfigError, match="--model-dir"):
        profile_cluster(load_cluster(cluster), settings=QUICK)


def test_estimate_command_writes_a_profiles_file(tmp_path: Path) -> None:
    out = tmp_path / "est.yaml"
    assert helix_main(["profile", "--estimate", "--gpus", "A100,L4,T4,H100,V100,A10G,RTX4090,A100-80GB",
                       "--model", "llama-2-70b", "-o", str(out)]) == 0  # fmt: skip
    profiles = load_profile_file(out)
    assert len(profiles.gpus) == 8
    assert profiles.throughput("L4", "llama-2-70b").max_layers == 7
    # --cluster: GPU types and model from the cluster; the planner can load the result
    cluster = ROOT / "clusters" / "helix-paper-single24" / "cluster.yaml"
    out2 = tmp_path / "paper-est.yaml"
    assert helix_main(["profile", "--estimate", "--cluster", str(cluster), "-o", str(out2)]) == 0
    assert set(load_profile_file(out2).gpus) == {"A100", "L4", "T4"}


def test_agent_batch_limits_match_the_agent_defaults() -> None:
    from node_agent.scheduler import SchedulerConfig
    from profiler.cluster_profile import AGENT_MAX_BATCH_SIZE, AGENT_PREFILL_CHUNK_TOKENS

    agent = SchedulerConfig()
    assert (AGENT_PREFILL_CHUNK_TOKENS, AGENT_MAX_BATCH_SIZE) == (agent.chunk_size, agent.max_batch_size)


def test_cached_rerun_does_not_load_torch(demo: Path) -> None:
    import dataclasses
    import subprocess
    import sys

    profile_cluster(load_cluster(demo), settings=QUICK, measure_links=False)
    script = (
        "import sys\n"
        "from helix.spec import load_cluster\n"
        "from profiler.cluster_profile import profile_cluster\n"
        "from profiler.measure import MeasureSettings\n"
        f"s = MeasureSettings(**{dataclasses.asdict(QUICK)!r})\n"
        f"r = profile_cluster(load_cluster({str(demo)!r}), settings=s, measure_links=False)\n"
        "assert r.cache_hits == ['cpu'], r.cache_hits\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_probe_stages_stream_their_weights_from_memory() -> None:
    from node_agent.config import load_config
    from node_agent.gguf_convert import cached_model_dir
    from profiler.device import probe_stage_layers

    layer = load_config(cached_model_dir()).layer_weight_bytes(4)
    assert layer == 14160384  # SmolLM2-135M: 576 hidden, 1536 MLP, 9 heads / 3 KV heads of 64, float32
    short, long = probe_stage_layers(30, layer, 32 << 20)  # a 32 MiB L3
    assert short * layer >= 2 * (32 << 20) and long >= 2 * short and long <= 28
    assert probe_stage_layers(80, 1_700_000_000, 40 << 20) == (1, 4)  # a GPU's L2 holds no layer
    assert probe_stage_layers(30, layer, 0, longer=1) == (1, 2)  # explicit (tests): the old 1-layer probe
    assert probe_stage_layers(4, layer, 1 << 40) == (1, 2)  # a tiny model: whatever fits between first and last


def test_concurrent_profile_measures_every_colocated_node_together(demo: Path) -> None:
    # the three measuring processes wait for each other (LOADED / go) before timing anything
    result = profile_cluster(load_cluster(demo), settings=QUICK, concurrent=True, measure_links=False)
    assert sorted(result.per_node) == ["cpu-0", "cpu-1", "cpu-2"]
    tp = load_profile_file(result.profiles_path).throughput("cpu", "smollm2-135m")
    assert tp.decode_ms_per_layer and all(ms > 0 for b, ms in tp.decode_ms_per_layer if b > 0)
    # the same curves stepping alone (one node at a time), for the simulator's crowding (simulator.hosts)
    together = min(3, os.cpu_count() or 1)
    if together >= 2:
        assert tp.alone is not None and tp.alone.together == together
        assert all(ms > 0 for b, ms in tp.alone.decode_ms_per_layer if b > 0)
    else:  # one core: the nodes never stepped at once, so there is nothing to tell apart
        assert tp.alone is None


@pytest.mark.vllm
def test_profile_through_the_vllm_backend_is_measured_and_cached_apart(demo: Path, tmp_path: Path) -> None:
    """`helix profile --backend vllm`: the curves come from vLLM's layers, cached under their own key."""
    cluster = load_cluster(demo)
    vllm = replace(QUICK, backend="vllm")
    result = profile_cluster(cluster, settings=vllm, measure_links=False, cache_dir=tmp_path / "cache")
    assert result.measured == ["cpu"] and not result.cache_hits
    measured = yaml.safe_load(result.profiles_path.read_text())["gpus"]["cpu"]["throughput"][cluster.model]
    assert all(ms > 0 for t, ms in measured["prefill_ms_per_layer"] + measured["decode_ms_per_layer"] if t > 0)
    torch_run = profile_cluster(cluster, settings=QUICK, measure_links=False, cache_dir=tmp_path / "cache")
    assert torch_run.measured == ["cpu"] and not torch_run.cache_hits  # another backend: not the vLLM cache entry
    again = profile_cluster(cluster, settings=vllm, measure_links=False, cache_dir=tmp_path / "cache")
    assert again.cache_hits == ["cpu"]


def test_a_busy_machine_is_warned_of_before_a_cpu_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes' load goes into every measured step: the profile says so (helix profile prints it)."""
    from helix.profile import ProfileSet
    from profiler import cluster_profile
    from profiler.cluster_profile import BUSY_WARNING_SHARE, ClusterProfileResult, _check_quiet

    said: list[tuple[str, str]] = []
    for busy, warned in ((0.9, True), (BUSY_WARNING_SHARE / 2, False)):
        monkeypatch.setattr(cluster_profile, "busy_share", lambda busy=busy: busy)
        result = ClusterProfileResult(profiles_path=Path("p.yaml"), links_path=None, profiles=ProfileSet())
        _check_quiet(result, lambda phase, msg: said.append((phase, msg)))
        assert result.busy_before == busy
        assert bool(result.warnings) is warned
    assert len(said) == 1 and "90% busy" in said[0][1] and "--force" in said[0][1]
    assert 0.0 <= cluster_profile.busy_share(0.05) <= 1.0  # the real reading
