"""The Helix paper's artifact data (``../shared/bench/helix-paper-single24``) in our formats.

``python bench/paper_data.py`` (re)writes ``clusters/helix-paper-single24/`` from it: the
cluster (links as 8 Gbit/s so that, like the paper's code, they carry 1e9 bytes/s), the
LLaMA-2 70B profiles and the paper's placements as plan files under ``reference/``.
Benchmarks import :func:`reference_placements` and :data:`REFERENCE` from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench" / "helix-paper-single24"
OUT = ROOT / "clusters" / "helix-paper-single24"
MODEL = "llama-2-70b"
PLACEMENT_FILES = {"helix_milp": "milp", "petals": "petals", "swarm": "swarm"}


def node_id(num: int, gpu: str) -> str:
    return f"{gpu.lower()}-{num}"


def _pairs(points: list[list[float]]) -> list[list[float]]:
    return [[float(x), float(y)] for x, y in points]


def convert() -> None:
    cluster = yaml.safe_load((SHARED / "cluster.yaml").read_text())
    gpus = yaml.safe_load((SHARED / "gpus-llama70b.yaml").read_text())
    ref = yaml.safe_load((SHARED / "reference.yaml").read_text())
    bw = {link["bandwidth_bps"] for link in cluster["links"]}
    lat = {link["latency_s"] for link in cluster["links"]}
    assert bw == {1e9} and lat == {0.001}, "single24 has one kind of link"
    m = gpus["model"]
    profiles = {
        "models": {
            MODEL: {
                "num_layers": m["num_layers"],
                "hidden_size": m["hidden_size"],
                "dtype_bytes": m["activation_bytes_per_token"] // m["hidden_size"],
                "layer_weight_bytes": m["weight_bytes_per_layer_used_by_paper"],
                "kv_bytes_per_token_per_layer": m["kv_bytes_per_token_per_layer_fp16"],
                "token_bytes": m["token_bytes"],
            }
        },
        "gpus": {
            name: {
                "vram_gb": g["machine"]["vram_size_bytes"] / 1e9,
                "throughput": {
                    MODEL: {
                        "max_layers": g["max_layers"],
                        "tok_s": g["tokens_per_s_by_layers"],
                        "prefill_ms_per_layer": _pairs(g["prefill_ms_per_layer_vs_batch_tokens"]),
                        "decode_ms_per_layer": _pairs(g["decode_ms_per_layer_vs_batch_size"]),
                        "kv_capacity_tokens_by_layers": g["kv_cache_token_layer_entries_by_layers"],
                        "prompt_max_tokens_by_layers": g["prompt_max_tokens_by_layers"],
                        "decode_max_tokens_by_layers": g["decode_max_tokens_by_layers"],
                    }
                },
            }
            for name, g in gpus["gpus"].items()
        },
    }
    spec = {
        "name": "helix-paper-single24",
        "model": MODEL,
        "profiles": "profiles-llama70b.yaml",
        "coordinator": {"id": "coordinator", "nic_gbps": cluster["coordinator"]["source_outbound_nic_bps"] / 1e9},
        "nodes": [{"id": node_id(n["id"], n["gpu"]), "gpu": n["gpu"], "region": "paper"} for n in cluster["nodes"]],
        "defaults": {"intra_region": {"bandwidth_gbps": 8.0, "latency_ms": 1.0}},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    header = (
        "# The Helix paper's single-region cluster (section 6.3): 4 A100-40GB, 8 L4, 12 T4, LLaMA-2 70B.\n"
        "# Converted by bench/paper_data.py from the paper's artifact. Every link is the same; the paper's\n"
        "# code treats its '1000 mbps' as 1e9 BYTES/s, hence 8 Gbit/s here to reproduce its max flows.\n"
    )
    (OUT / "cluster.yaml").write_text(header + yaml.safe_dump(spec, sort_keys=False))
    (OUT / "profiles-llama70b.yaml").write_text(
        "# LLaMA-2 70B on A100/L4/T4 from the Helix paper's artifact (bench/paper_data.py).\n"
        "# tok_s: the paper's node capacities; the latency curves are per ONE layer, measured with vLLM.\n"
        + yaml.safe_dump(profiles, sort_keys=False)
    )
    (OUT / "reference").mkdir(exist_ok=True)
    for key, fname in PLACEMENT_FILES.items():
        p = ref["placements"][key]
        plan = {
            "cluster": "helix-paper-single24",
            "model": MODEL,
            "method": f"paper-{fname}",
            "placement": {node_id(x["node"], x["gpu"]): [x["start"], x["end"]] for x in p["layers_by_node"]},
            "max_flow_tok_s": p["max_flow_tok_s"]["milp_model_partial"],
            "status": "reference",
            "stats": {"source": "Helix paper artifact, reference.yaml"},
        }
        (OUT / "reference" / f"{fname}.json").write_text(json.dumps(plan, indent=2) + "\n")


REFERENCE = {
    "milp": 1289.5558,
    "swarm": 757.8532,
    "petals": 952.1074,
    "petals_no_partial": 531.7026,
    "compute_upper_bound": 2803.861,
    "sim_decode_tok_s": {"milp": 252.1, "swarm": 124.7, "separate_pipelines": 124.3},
}


def reference_plan_path(name: str) -> Path:
    return OUT / "reference" / f"{name}.json"


if __name__ == "__main__":
    convert()
    print(f"wrote {OUT}")
