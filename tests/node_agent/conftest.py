"""Fixtures for the engine tests: one CPU thread, SmolLM2 converted once, random tiny Llamas, and a
bare coordinator to drive an agent's control socket by hand."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from helix import wire
from helix.handshake import CoordinatorHandshake

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from node_agent.gguf_convert import cached_model_dir

    return cached_model_dir()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


SMOLLM2_PROMPT_LENS = (5, 41, 17, 90, 3, 64, 33, 120, 8)
SMOLLM2_NEW_TOKENS = 10  # the length of every hf_greedy continuation


@pytest.fixture(scope="session")
def smollm2_prompts() -> list[list[int]]:
    """Nine random-token prompts of mixed lengths (3 to 120), the same in every test."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in SMOLLM2_PROMPT_LENS]


@pytest.fixture(scope="session")
def hf_greedy(smollm2_hf: Any, smollm2_prompts: list[list[int]]) -> list[list[int]]:
    """``transformers``' greedy continuation (SMOLLM2_NEW_TOKENS tokens) of each of ``smollm2_prompts``."""
    out = []
    for prompt in smollm2_prompts:
        ids = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=SMOLLM2_NEW_TOKENS,
                                  min_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa-tied-llama3": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mha-untied-linear": dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500.0,
    ),
    "mqa-default-headdim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False),
}


def make_tiny_llama(root: Path, name: str, num_layers: int = 4) -> tuple[Path, Any]:
    """A random-init ``LlamaForCausalLM`` saved as a HF dir; returns (dir, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(zlib.crc32(name.encode()))
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=num_layers,
                         max_position_embeddings=256, rms_norm_eps=1e-5, **TINY_VARIANTS[name])
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger-than-init weights so layers really change the hidden states
        for p in model.parameters():
            p.mul_(5.0)
    out = root / name
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="session", params=sorted(TINY_VARIANTS))
def tiny_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), request.param)


def require_native() -> Any:
    """The native kernels (``torch.ops.helix``); they must build here (skip only when disabled on purpose)."""
    from node_agent import native

    if native.disabled():
        pytest.skip("native kernel disabled by HELIX_NATIVE=0")
    kernels = native.ops()
    assert kernels is not None, f"native kernels did not build: {native.unavailable_reason()}"
    return kernels


@pytest.fixture
def native_ops() -> Any:
    return require_native()


@pytest.fixture(params=["native", "sdpa"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the native kernels, then through the PyTorch path (per-request SDPA, F.rms_norm)."""
    from node_agent import native

    if request.param == "native":
        require_native()
    else:
        monkeypatch.setattr(native, "ops", lambda: None)
    return str(request.param)


class BareCoordinator:
    """A bare coordinator: a DEALER to an agent's control socket (the handshake done with
    :class:`CoordinatorHandshake`; ``welcome``: the agent's WELCOME) and a PULL sink for its TOKENS."""

    def __init__(self, ctx: zmq.Context[Any], control: str, node_id: str, secret: bytes) -> None:
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        self.dealer.connect(control)
        self.sink = ctx.socket(zmq.PULL)
        self.sink.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt_string(zmq.LAST_ENDPOINT)
        handshake = CoordinatorHandshake(secret, "test-coordinator", node_id)
        self.send(handshake.start())
        while True:
            msg = self.control_reply()
            outcome = handshake.on_message(msg)  # type: ignore[arg-type]
            assert outcome.error is None, outcome.error
            for reply in outcome.replies:
                self.send(reply)
            if outcome.trusted:
                assert isinstance(msg, wire.Welcome)
                self.welcome = msg  # what the agent holds
                return

    def send(self, msg: wire.Message) -> None:
        self.dealer.send_multipart(wire.encode(msg))

    def control_reply(self) -> wire.Message:
        """The next control message that is not a heartbeat."""
        while True:
            msg = wire.decode(self.dealer.recv_multipart())
            if not isinstance(msg, wire.Heartbeat):
                return msg

    def token(self) -> wire.TokenOut:
        msg = wire.decode(self.sink.recv_multipart())
        assert isinstance(msg, wire.Tokens) and len(msg.tokens) == 1, msg
        return msg.tokens[0]
