"""Serving bench: the coordinator's own ceiling, and the demo cluster end to end.

(a) ``helix serve`` (a subprocess) in front of fake agents that answer instantly. The fakes speak
    the real wire protocol (shared-secret handshake, heartbeats, ADMIT/CANCEL in, TOKENS out) and
    emit one token per running request per loop turn, as fast as they can. Many concurrent
    streaming clients (httpx, SSE) run against it: reports errors, the tokens/s the coordinator
    delivered, and its CPU seconds per 1000 tokens.
(b) The demo cluster end to end (3 SmolLM2-135M agents on loopback, planned by the planner, one
    torch thread each, ``helix serve`` in front): time to first token and tokens/s under 1, 8 and
    32 concurrent chat clients, beside one process running the same engine with all layers on
    the same requests.

    python bench/serving.py [--part a|b|all] [--rounds 3] [--concurrency 300] [--requests 600] [--max-tokens 32]

Both parts run in rounds (``bench/harness.py``): the processes start once, then each round runs
the load again ((b): the cluster and the one-process engine in ABBA order) and the figures are
medians over the rounds with their spread; (a)'s target (>= 300 concurrent streams with no
errors) is judged on the median error count, with how many rounds had none. The machine is
shared (2 cores): absolute figures are noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))  # after the packages: bench/router.py must not shadow router/
from harness import RoundLog, Target, add_rounds_option, arm_order, figures_table, make_console, report  # noqa: E402

DEMO_CLUSTER = REPO / "clusters" / "demo" / "cluster.yaml"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
           "List some uses of a paperclip.", "Describe a walk in a forest in autumn."]


# -- fake agents -----------------------------------------------------------------------------------


def fake_agents_main(nodes: dict[str, tuple[int, int]], secret: bytes, token_ids: list[int], ready: mp.Queue,
                     stop: mp.Event) -> None:
    """Run one fake agent per node (node -> its layer range) in this process (one loop over all their sockets)."""
    import zmq

    from helix import wire
    from helix.domain import FinishReason

    ctx = zmq.Context()
    agents = {}
    for node in nodes:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        agents[sock] = {"node": node, "coordinators": set(), "pending": {}}
        ready.put((node, sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    pushers: dict[str, zmq.Socket] = {}
    running: dict[str, list] = {}  # wire id -> [reply_to, step, max_tokens, node]
    poller = zmq.Poller()
    for sock in agents:
        poller.register(sock, zmq.POLLIN)
    next_hb = 0.0
    while not stop.is_set():
        for sock, _ in poller.poll(0 if running else 20):
            state = agents[sock]
            while True:
                try:
                    identity, *frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = wire.decode(frames)
                if isinstance(msg, wire.Hello):
                    nonce = wire.make_nonce()
                    state["pending"][identity] = (msg.nonce, nonce)
                    proof = wire.prove(secret, "agent", msg.nonce, nonce)
                    sock.send_multipart([identity, *wire.encode(wire.Challenge(state["node"], nonce, proof))])
                elif isinstance(msg, wire.Auth):
                    theirs, ours = state["pending"].pop(identity)
                    if wire.verify(secret, msg.proof, "coordinator", ours, theirs):
                        state["coordinators"].add(identity)
                        sock.send_multipart([identity, *wire.encode(wire.Welcome(
                            state["node"], *nodes[state["node"]], 10**9, "tcp://127.0.0.1:1"))])
                elif isinstance(msg, wire.Admit):
                    running[msg.request_id] = [msg.reply_to, 0, msg.max_tokens, state["node"]]
                elif isinstance(msg, wire.Cancel):
                    running.pop(msg.request_id, None)
        out: dict[tuple[str, str], list] = {}
        for rid, r in list(running.items()):
            reply_to, step, max_tokens, node = r
            done = step + 1 >= max_tokens
            out.setdefault((reply_to, node), []).append(
                wire.TokenOut(rid, step, token_ids[step % len(token_ids)], FinishReason.LENGTH if done else None))
            r[1] += 1
            if done:
                del running[rid]
        for (reply_to, node), tokens in out.items():
            if reply_to not in pushers:
                pushers[reply_to] = ctx.socket(zmq.PUSH)
                pushers[reply_to].setsockopt(zmq.LINGER, 0)
                pushers[reply_to].connect(reply_to)
            pushers[reply_to].send_multipart(wire.encode(wire.Tokens(node, tuple(tokens))))
        now = time.monotonic()
        if now >= next_hb:
            next_hb = now + 0.25
            for sock, state in agents.items():
                hb = wire.Heartbeat(state["node"], int(now * 4), 0, 0, 10**9, 0, len(running))
                for identity in state["coordinators"]:
                    sock.send_multipart([identity, *wire.encode(hb)])
    ctx.destroy(linger=0)


# -- coordinator subprocess and load generator ------------------------------------------------------


def start_serve(cluster: Path, plan: Path, agents: dict[str, str], secret: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "helix.cli", "serve", "--cluster", str(cluster), "--plan", str(plan),
           "--port", str(port), "--queue-bound", "4096"]
    for node, address in agents.items():
        cmd += ["--agent", f"{node}={address}"]
    proc = subprocess.Popen(cmd, env={**os.environ, "HELIX_SECRET": secret}, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"helix serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("helix serve did not become ready")


@dataclass
class LoadResult:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: mean time between its streamed chunks
    wall_s: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def ttft_ms(self, q: float) -> float:
        return _quantile_ms(self.ttft_s, q)

    def tpot_ms(self, q: float) -> float:
        return _quantile_ms(self.tpot_s, q)


def _quantile_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_load(base: str, concurrency: int, total: int, max_tokens: int, *, chat: bool) -> LoadResult:
    """``concurrency`` clients stream ``total`` requests in all; each client runs its share in turn."""
    result = LoadResult()
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    queue = list(range(total))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        body: dict = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        t0 = time.monotonic()
        first, last, chunks, done, tokens = None, 0.0, 0, False, 0
        async with client.stream("POST", f"/v1/{'chat/' if chat else ''}completions", json=body) as resp:
            if resp.status_code != 200:
                result.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    result.errors.append(obj["error"]["message"])
                    return
                choice = (obj.get("choices") or [{}])[0]
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text:
                    last, chunks = time.monotonic() - t0, chunks + 1
                    if first is None:
                        first = last
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
        if not done:
            result.errors.append("stream ended without [DONE]")
            return
        result.requests += 1
        result.tokens += tokens
        if first is not None:
            result.ttft_s.append(first)
        if first is not None and chunks > 1:
            result.tpot_s.append((last - first) / (chunks - 1))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            try:
                await one(client, i)
            except httpx.HTTPError as exc:
                result.errors.append(f"{type(exc).__name__}: {exc}")

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        result.wall_s = time.monotonic() - t0
    return result


# -- (a) coordinator ceiling -----------------------------------------------------------------------


def part_a(concurrency: int, total: int, max_tokens: int, rounds: int) -> None:
    from helix.processes import cpu_seconds as process_cpu_seconds
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import finish_plan
    from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir

    cluster = load_cluster(DEMO_CLUSTER)
    workdir = Path(tempfile.mkdtemp(prefix="helix-bench-"))
    plan_path = workdir / "plan.json"
    # the first node holds every layer, the others split them (the demo caps them at 16 layers): three pipelines
    layers = load_profiles_for(cluster).models[cluster.model].num_layers
    others = [n.id for n in cluster.nodes[1:]]
    placement = {cluster.nodes[0].id: (0, layers)} | {
        node: (i * layers // len(others), (i + 1) * layers // len(others)) for i, node in enumerate(others)}
    finish_plan(cluster, load_profiles_for(cluster), placement, method="manual").save(plan_path)
    token_ids = ChatTokenizer.from_dir(ensure_tokenizer_dir(None)).encode(" the quick brown fox jumps over the lazy dog")
    secret = secrets.token_hex(8)
    ready, stop = mp.Queue(), mp.Event()
    fakes = mp.Process(target=fake_agents_main, args=(placement, secret.encode(), token_ids,
                                                      ready, stop), daemon=True)
    fakes.start()
    addresses = dict(ready.get(timeout=30) for _ in cluster.nodes)
    serve, base = start_serve(DEMO_CLUSTER, plan_path, addresses, secret)
    log, first_error = RoundLog(), ""
    try:
        asyncio.run(run_load(base, 8, 16, max_tokens, chat=False))  # warm-up
        for r in log.each_round(rounds, lambda text: print(f"    (a) {text}", flush=True)):
            cpu0 = process_cpu_seconds(serve.pid)
            res = asyncio.run(run_load(base, concurrency, total, max_tokens, chat=False))
            cpu = process_cpu_seconds(serve.pid) - cpu0
            first_error = first_error or (res.errors[0] if res.errors else "")
            log.record(r, "failed requests", total - res.requests, "")
            log.record(r, "delivered tokens/s", res.tok_s, "tok/s")
            log.record(r, "coordinator CPU-s per 1000 tokens", 1000 * cpu / max(1, res.tokens), "s")
            log.record(r, "ceiling on one core, tokens/s", res.tokens / max(cpu, 1e-9), "tok/s")
            log.record(r, "TTFT p50", res.ttft_ms(0.5), "ms")
            log.record(r, "TTFT p99", res.ttft_ms(0.99), "ms")
            log.record(r, "time between tokens p50", res.tpot_ms(0.5), "ms")
    finally:
        serve.terminate()
        serve.wait(timeout=20)
        stop.set()
        fakes.join(timeout=10)
    print()
    report(CONSOLE, log, f"(a) coordinator vs instant fake agents: {concurrency} concurrent streaming clients, {total} "
                         f"requests x {max_tokens} tokens per round", {"failed requests": Target("<=", 0, unit="")})
    if first_error:
        CONSOLE.print(f"first error: {first_error}")


# -- (b) demo cluster end to end vs one engine process -------------------------------------------


def plan_demo(workdir: Path) -> Path:
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import make_plan

    cluster = load_cluster(DEMO_CLUSTER)
    profiles = load_profiles_for(cluster)
    try:
        plan = make_plan(cluster, profiles, method="helix", time_limit_s=20, threads=1)
    except Exception:  # noqa: BLE001 - method unavailable in this build
        plan = make_plan(cluster, profiles, method="paper-milp", time_limit_s=20, threads=1)
    path = workdir / "plan.json"
    plan.save(path)
    print(f"    demo plan ({plan.method}): {dict(plan.placement)}")
    return path


class OneProcess:
    """The same chat requests on one process holding all layers (node_agent.engine, 1 torch thread)."""

    def __init__(self) -> None:
        import torch

        from node_agent.engine import StageEngine
        from node_agent.gguf_convert import cached_model_dir
        from node_agent.sampling import SamplingParams
        from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir

        torch.set_num_threads(1)
        model_dir = ensure_tokenizer_dir(cached_model_dir())
        self.tok = ChatTokenizer.from_dir(model_dir)
        self.engine = StageEngine(model_dir)
        self.params = SamplingParams
        self.served = 0  # request ids stay unique across rounds

    def load(self, level: int, max_tokens: int) -> LoadResult:
        """``max(level, 4)`` requests in waves of ``level`` (the clients' concurrency)."""
        total, res, stops = max(level, 4), LoadResult(), tuple(self.tok.eos_token_ids)
        t0 = time.monotonic()
        for wave in range(0, total, level):
            start = time.monotonic()
            first: dict[str, float] = {}
            for i in range(wave, min(total, wave + level)):
                ids = self.tok.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
                self.served += 1
                self.engine.add_request(f"r{self.served}", self.params(max_tokens=max_tokens, stop_token_ids=stops),
                                        prompt_token_ids=ids)
            while self.engine.has_unfinished:
                for o in self.engine.step().outputs:
                    if o.token is not None:
                        res.tokens += 1
                        first.setdefault(o.request_id, time.monotonic() - start)
                        if o.finish_reason is not None:
                            res.requests += 1
            res.ttft_s += list(first.values())
        res.wall_s = time.monotonic() - t0
        return res


def part_b(levels: list[int], max_tokens: int, rounds: int) -> None:
    from helix.plan import load_plan
    from router.launch import AgentProcesses

    print("\n(b) demo cluster end to end (3 agents + helix serve) vs one engine process")
    workdir = Path(tempfile.mkdtemp(prefix="helix-bench-"))
    plan = plan_demo(workdir)
    secret = secrets.token_hex(8)
    nodes = list(load_plan(plan).placement)
    log = RoundLog()
    with AgentProcesses(DEMO_CLUSTER, plan, workdir, secret=secret) as agents:
        agents.start(nodes)
        addresses = agents.wait_ready(timeout_s=300)
        serve, base = start_serve(DEMO_CLUSTER, plan, addresses, secret)
        try:
            asyncio.run(run_load(base, 1, 1, 4, chat=True))  # warm-up
            one = OneProcess()  # the agents idle meanwhile (their heartbeats only)
            one.load(1, 4)  # warm-up
            for r in log.each_round(rounds, lambda text: print(f"    (b) {text}", flush=True)):
                for arm in arm_order(["cluster", "engine"], r):
                    for level in levels:
                        if arm == "cluster":
                            res = asyncio.run(run_load(base, level, max(level, 4), max_tokens, chat=True))
                            log.record(r, f"cluster errors @{level}", len(res.errors))
                        else:
                            res = one.load(level, max_tokens)
                        log.record(r, f"{arm} tok/s @{level}", res.tok_s, "tok/s")
                        log.record(r, f"{arm} TTFT p50 @{level}", res.ttft_ms(0.5), "ms")
                        log.record(r, f"{arm} TTFT p99 @{level}", res.ttft_ms(0.99), "ms")
                        if arm == "cluster":  # the engine arm does not stream
                            log.record(r, f"cluster time between tokens p50 @{level}", res.tpot_ms(0.5), "ms")
                for level in levels:
                    log.ratio(f"cluster ÷ engine tok/s @{level}", f"cluster tok/s @{level}", f"engine tok/s @{level}")
        finally:
            serve.terminate()
            serve.wait(timeout=20)
    names = [f"{what} @{level}" for level in levels for what in (
        "cluster tok/s", "cluster TTFT p50", "cluster TTFT p99", "cluster errors",
        "engine tok/s", "engine TTFT p50", "engine TTFT p99", "cluster time between tokens p50",
        "cluster ÷ engine tok/s")]
    CONSOLE.print(figures_table(log, f"(b) demo cluster vs one engine process, {max_tokens} max tokens, "
                                     f"@N = N concurrent chat clients, {rounds} round(s) (no target: reported)", names=names))
    CONSOLE.print(f"[dim]{log.timing_line()}[/]")


CONSOLE = make_console()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["a", "b", "all"], default="all")
    add_rounds_option(p, 3, "(a) ~30 s and (b) ~2 min per round here")
    p.add_argument("--concurrency", type=int, default=300)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--levels", default="1,8,32")
    args = p.parse_args()
    print(f"serving bench on {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f})")
    if args.part in ("a", "all"):
        part_a(args.concurrency, args.requests, args.max_tokens, args.rounds)
    if args.part in ("b", "all"):
        part_b([int(x) for x in args.levels.split(",")], args.max_tokens, args.rounds)
    print(f"(mean load average during the run: {statistics.mean(os.getloadavg()):.1f})")


if __name__ == "__main__":
    main()
