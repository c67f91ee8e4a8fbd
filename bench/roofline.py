"""Roofline estimates vs the Helix paper's vLLM measurements (A100, L4, T4; LLaMA-2 70B).

``python bench/roofline.py`` prints, per GPU, estimate / paper ratios of:

* per-layer prefill latency at several batch-token counts and decode latency at several batch
  sizes (the paper's measured curves, linearly interpolated);
* the layer limit and the KV capacity with one layer held;
* tokens/s through k layers derived by ``helix.profile.derive_tok_s`` from each side's curves
  (same formula on both sides), and against the ``tok_s`` table the paper's planner used.

The ratio of a correct estimate is 1; > 1 means the spec sheet promises more time (latency) or
more tokens/s (throughput) than the paper measured.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helix.profile import ThroughputProfile, derive_tok_s  # noqa: E402
from profiler.gpus import BUILTIN_MODELS, gpu_spec  # noqa: E402
from profiler.roofline import Roofline, estimate_throughput  # noqa: E402

PAPER = ROOT.parent / "shared" / "bench" / "helix-paper-single24" / "gpus-llama70b.yaml"
PREFILL_TOKENS = (250, 1000, 2000, 4000)
DECODE_BATCHES = (8, 64, 140, 300, 460)


def _interp(points: list[list[float]], x: float) -> float:
    pts = sorted((p[0], p[1]) for p in points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise ValueError(f"{x} outside the measured range")


def main() -> int:
    if not PAPER.is_file():
        print(f"missing {PAPER}", file=sys.stderr)
        return 1
    paper = yaml.safe_load(PAPER.read_text())["gpus"]
    model = BUILTIN_MODELS["llama-2-70b"]
    rl = Roofline()
    console = Console(highlight=False)
    lat = Table(title="per-layer latency: estimate / paper (ms ratio)")
    lat.add_column("GPU")
    for t in PREFILL_TOKENS:
        lat.add_column(f"prefill {t} tok", justify="right")
    for b in DECODE_BATCHES:
        lat.add_column(f"decode b={b}", justify="right")
    mem = Table(title="memory: estimate vs paper")
    for col in ("GPU", "max layers (est/paper)", "KV entries 1 layer (est/paper)"):
        mem.add_column(col, justify="right")
    tok = Table(title="tokens/s through k layers: estimate / paper")
    for col in ("GPU", "derive_tok_s est/derived-paper (k=1..max)", "geo-mean", "est / paper tok_s table",
                "derived-paper / paper tok_s table"):  # fmt: skip
        tok.add_column(col, justify="right")
    for gpu in ("A100", "L4", "T4"):
        p = paper[gpu]
        spec = gpu_spec(gpu)
        pre, dec = p["prefill_ms_per_layer_vs_batch_tokens"], p["decode_ms_per_layer_vs_batch_size"]
        cells = [f"{rl.prefill_ms(spec, model, t) / _interp(pre, t):.2f}" for t in PREFILL_TOKENS]
        cells += [f"{rl.decode_ms(spec, model, b) / _interp(dec, b):.2f}" for b in DECODE_BATCHES]
        lat.add_row(gpu, *cells)
        est = estimate_throughput(spec, model, rl)
        kv_paper = p["kv_cache_token_layer_entries_by_layers"]
        mem.add_row(gpu, f"{est.max_layers} / {p['max_layers']}",
                    f"{est.kv_capacity_tokens_by_layers[0] / kv_paper[0]:.3f}")  # type: ignore[index]  # fmt: skip
        measured = ThroughputProfile(
            max_layers=p["max_layers"],
            prefill_ms_per_layer=[tuple(x) for x in pre],
            decode_ms_per_layer=[tuple(x) for x in dec],
            kv_capacity_tokens_by_layers=kv_paper,
        )
        k = min(est.max_layers, p["max_layers"])
        e, m, table = derive_tok_s(est)[:k], derive_tok_s(measured)[:k], p["tokens_per_s_by_layers"][:k]
        ratios = [a / b for a, b in zip(e, m, strict=True)]
        geo = statistics.geometric_mean(ratios)
        tok.add_row(gpu, " ".join(f"{r:.2f}" for r in ratios), f"{geo:.2f}",
                    f"{statistics.geometric_mean([a / b for a, b in zip(e, table, strict=True)]):.2f}",
                    f"{statistics.geometric_mean([a / b for a, b in zip(m, table, strict=True)]):.2f}")  # fmt: skip
    console.print(lat)
    console.print(mem)
    console.print(tok)
    console.print(
        f"model: compute eff {rl.compute_eff}, memory eff {rl.memory_eff}, overhead {rl.layer_overhead_ms} ms/layer, "
        f"memory utilization {rl.memory_utilization}, reserve {rl.reserve_bytes / 1e9:g} GB "
        "(one set of constants for every GPU; see docs/profiler.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
