"""The engine on a GPU: our torch backend on CUDA against transformers on the same weights, and
what a decode step costs as the batch grows there.

Run where a CUDA GPU is (this repo's CI has none)::

    python bench/gpu_engine.py --model-dir DIR            # a HF-style model dir (config.json + safetensors)
    python bench/gpu_engine.py --random-like CONFIG_DIR   # random weights (seed 0) shaped like CONFIG_DIR's model

``--random-like`` is for machines the real weights cannot reach: transformers initialises the
model of ``CONFIG_DIR/config.json`` (its init, seed 0) and saves it with the tokenizer files beside
it; the comparison is as exact on random weights as on trained ones (the same tensors on both
sides), the step costs the same.

1. **Agreement.** For float32 and bfloat16: four prompts of random token ids, 32 greedy tokens
   each from our engine (one batch, iteration-level); transformers then scores each of our
   sequences in one forward pass (teacher forcing, so one early difference does not compound), and
   the figures are the share of our tokens that are transformers' argmax too, and the largest
   logit difference relative to the logits' spread.
2. **Decode step cost by batch size** (1, 4, 16, 64 requests, 128-token contexts): the median step
   time and its ratio to batch 1, the number that decides what iteration-level batching gains.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node_agent.backends import StageBackend  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself on a machine without a GPU


def random_model(like: Path, out: Path) -> Path:
    """A model shaped like ``like``'s config.json with transformers' own random init (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    return out


def our_greedy(model_dir: Path, dtype: str, prompts: list[list[int]], n: int) -> list[tuple[list[int], torch.Tensor]]:
    """Our engine's greedy tokens and their logits rows, all prompts in one iteration-level batch."""
    engine = StageEngine(model_dir, kv_capacity_tokens=1 << 14, backend=StageBackend("torch", dtype, DEVICE),
                         scheduler=SchedulerConfig(max_batch_size=len(prompts), token_budget=4096, chunk_size=None))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", SamplingParams(max_tokens=n, return_logits=True), prompt_token_ids=p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step().outputs:
            if out.token is not None:
                tokens[out.request_id].append(out.token)
                assert out.logits is not None
                logits[out.request_id].append(out.logits.float().cpu())
    return [(tokens[f"r{i}"], torch.stack(logits[f"r{i}"])) for i in range(len(prompts))]


def reference_logits(model_dir: Path, dtype: str, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at each of our generated positions (teacher forcing on our sequence)."""
    model = _reference_model(model_dir, dtype)
    ids = torch.tensor([prompt + generated[:-1]], device=DEVICE)
    with torch.no_grad():
        out = model(input_ids=ids).logits[0].float().cpu()
    return out[len(prompt) - 1:]


_MODELS: dict[tuple[Path, str], torch.nn.Module] = {}


def _reference_model(model_dir: Path, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype)
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        _MODELS[key] = model.to(DEVICE).eval()  # type: ignore[arg-type]
    return _MODELS[key]


def agreement(model_dir: Path, dtype: str, n: int = 32) -> tuple[float, float]:
    """(share of our tokens that are transformers' argmax, max |logit diff| / logits' std)."""
    g = torch.Generator().manual_seed(1)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for length in (7, 33, 64, 120)]
    same = total = 0
    worst = 0.0
    for p, (generated, ours) in zip(prompts, our_greedy(model_dir, dtype, prompts, n), strict=True):
        ref = reference_logits(model_dir, dtype, p, generated)
        same += int((ref.argmax(-1) == torch.tensor(generated)).sum())
        total += len(generated)
        worst = max(worst, float((ours - ref).abs().max() / ref.std()))
    return same / total, worst


def decode_step_s(model_dir: Path, dtype: str, batch: int, context: int = 128) -> float:
    engine = StageEngine(model_dir, kv_capacity_tokens=1 << 16, backend=StageBackend("torch", dtype, DEVICE),
                         scheduler=SchedulerConfig(max_batch_size=batch, token_budget=batch * context,
                                                   chunk_size=None))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for i in range(batch):
        engine.add_request(f"d{i}", SamplingParams(max_tokens=64),
                           prompt_token_ids=torch.randint(0, 1000, (context,), generator=g).tolist())
    engine.step()  # every prompt, prefilled together
    for _ in range(3):
        engine.step()  # warm-up
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()  # ends by reading the sampled tokens back: waits for the device
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model-dir", type=Path, help="a HF-style model dir")
    group.add_argument("--random-like", type=Path, metavar="CONFIG_DIR",
                       help="random weights shaped like CONFIG_DIR/config.json (written to --out)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/helix-random-model"), help="where --random-like writes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of this script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_engine.py: no CUDA device is available to this PyTorch")
    model_dir = args.model_dir or random_model(args.random_like, args.out)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)"
    print(f"{where}, torch {torch.__version__}, model {model_dir}", flush=True)
    for dtype in ("float32", "bfloat16"):
        share, worst = agreement(model_dir, dtype)
        print(f"agreement {dtype}: {100 * share:.1f}% of our greedy tokens are transformers' argmax; "
              f"max |logit diff| = {worst:.3f} x the logits' std", flush=True)
    for dtype in ("float32", "bfloat16"):
        base = decode_step_s(model_dir, dtype, 1)
        row = [f"batch 1 {1e3 * base:.2f} ms"]
        for batch in (4, 16, 64):
            t = decode_step_s(model_dir, dtype, batch)
            row.append(f"batch {batch} {1e3 * t:.2f} ms ({t / base:.2f}x)")
        print(f"decode step {dtype}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
