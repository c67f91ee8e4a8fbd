"""The Llama-family decoder *stage*: the layers a stage holds, run on flattened tokens.

Selective batching (Orca): every linear op (QKV / O projections, MLP, norms) runs once on the
concatenated tokens of all requests in the step; attention runs per request against that
request's own KV cache. A request may carry a layer sub-range ``[a, b)`` inside the stage
(Helix's overlap resolution): at layer ``l`` only the rows of requests with ``a <= l < b`` are
computed, the rest pass through untouched. The stage that holds layer 0 owns the token
embedding; the stage that holds the last layer owns the final norm and the LM head.

The layers held may change while the stage serves (a re-plan, issue 18): :func:`build_parts` builds
new layers' weights off the engine thread, :meth:`StageModel.insert` adds them and
:meth:`StageModel.drop` frees some, each between two steps; a step runs only the layers its
requests need, so the layers held need not be contiguous.

A request may belong to a fine-tuned *task* (``Segment.task``): the shared ops still run once
over every row, then each task's PET op runs on its rows (:mod:`node_agent.task_ops`). A step with no
task rows runs exactly the base path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from node_agent import native, task_ops
from node_agent.config import ModelConfig, RopeConfig
from node_agent.kernels import Linear
from node_agent.kv_cache import RequestKV
from node_agent.stage_task import StageTask
from node_agent.weights import EMBED, FINAL_NORM, LAYER_TENSORS, LM_HEAD

# On a GPU, SDPA without its cuDNN backend: cuDNN builds an execution plan for every new KV
# length, and a request's length grows every step (measured on an H200 in bfloat16: 1.3 ms of
# CPU per attention call, 44 ms per SmolLM2 decode step at batch 1 against 12 ms in float32).
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for RoPE, with linear or llama3-style scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _native_for(*tensors: torch.Tensor) -> Any | None:
    """``torch.ops.helix`` if the native kernels exist and take these (float32 CPU) tensors, else ``None``."""
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return native.ops()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernels = _native_for(x, weight) if x.dim() == 2 and x.stride(-1) == 1 else None
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[gate | up]`` rows."""
    kernels = _native_for(gate_up) if gate_up.dim() == 2 and gate_up.stride(-1) == 1 else None
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and sign-folded ``sin`` ``[T, 1, head_dim]`` for :func:`apply_rope`, once per step."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on ``[T, heads, head_dim]``: rotate_half = roll * sign."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(slots=True)
class Segment:
    """One request's rows in a step: ``rows`` of the flattened batch, its KV, its layer sub-range."""

    rows: slice
    kv: RequestKV
    first_position: int
    layer_start: int
    layer_end: int
    task: StageTask | None = None  # the fine-tuned task the request runs, None for the base model

    @property
    def num_tokens(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # fused [q; k; v] rows
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # fused [gate; up] rows
    down: Linear

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.qkv, self.o_proj, self.gate_up, self.down)) + \
            _nbytes(self.input_norm) + _nbytes(self.post_norm)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(slots=True)
class StageParts:
    """Weights of some layers of a stage (and the embedding, final norm and LM head where asked),
    built from checkpoint tensors and ready to insert into a :class:`StageModel` between two steps."""

    layers: dict[int, LayerWeights]
    embed_tokens: torch.Tensor | None = None
    final_norm: torch.Tensor | None = None
    lm_head: Linear | None = None

    @property
    def nbytes(self) -> int:
        shared = self.lm_head is not None and self.lm_head.weight is not None and self.lm_head.weight is self.embed_tokens
        head = 0 if self.lm_head is None or shared else self.lm_head.nbytes
        return sum(w.nbytes for w in self.layers.values()) + _nbytes(self.embed_tokens) + \
            _nbytes(self.final_norm) + head


def build_parts(config: ModelConfig, layers: Iterable[int], tensors: dict[str, torch.Tensor], *, embed: bool,
                head: bool, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> StageParts:  # fmt: skip
    """The :class:`StageParts` of ``layers`` (and the embedding / final norm + LM head when ``embed`` /
    ``head``) from ``tensors`` (checkpoint names, :func:`node_agent.weights.stage_tensor_names`):
    fused, converted to ``dtype`` on ``device``, pre-packed. Touches no model: any thread may build."""
    device = torch.device(device)
    if (dtype, device.type) != (torch.float32, "cpu"):
        tensors = {name: t.to(device, dtype) for name, t in tensors.items()}
    parts = StageParts({})
    for i in layers:
        t = {name: tensors[f"model.layers.{i}.{name}"] for name in LAYER_TENSORS}
        parts.layers[i] = LayerWeights(
            input_norm=t["input_layernorm.weight"],
            qkv=Linear(torch.cat([t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"],
                                  t["self_attn.v_proj.weight"]])),
            o_proj=Linear(t["self_attn.o_proj.weight"]),
            post_norm=t["post_attention_layernorm.weight"],
            gate_up=Linear(torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]])),
            down=Linear(t["mlp.down_proj.weight"]),
        )
    if embed:
        parts.embed_tokens = tensors[EMBED]
    if head:
        parts.final_norm = tensors[FINAL_NORM]
        parts.lm_head = Linear(tensors[EMBED] if config.tie_word_embeddings else tensors[LM_HEAD])
    return parts


class StageModel:
    """Weights + forward math of the layers a stage holds; holds no per-request state.

    Built with layers ``[start, end)`` (none when ``start == end``); :meth:`insert` adds layers
    built by :func:`build_parts` and :meth:`drop` removes some, so the layers held may be any set
    (a re-plan's new range next to the old one). The embedding is held with layer 0, the final
    norm and LM head with the last layer.
    """

    def __init__(self, config: ModelConfig, start: int, end: int, tensors: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.dtype, self.device = dtype, torch.device(device)
        self.attention = StepAttention(config.num_heads, config.head_dim)
        self.layers: dict[int, LayerWeights] = {}
        self.embed_tokens: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Linear | None = None
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)
        self.insert(build_parts(config, range(start, end), tensors, embed=start == 0 < end,
                                head=start < end == config.num_layers, dtype=dtype, device=device))  # fmt: skip

    def insert(self, parts: StageParts) -> None:
        """Hold ``parts`` too (between two steps; replaces layers already held)."""
        self.layers.update(parts.layers)
        if parts.embed_tokens is not None:
            self.embed_tokens = parts.embed_tokens
        if parts.lm_head is not None:
            self.final_norm, self.lm_head = parts.final_norm, parts.lm_head
        if parts.layers:
            _native_for(next(iter(parts.layers.values())).input_norm)  # build / load the kernels now, not in a step

    def drop(self, layers: Iterable[int]) -> None:
        """Stop holding ``layers`` (between two steps): their weights are freed once no step uses them;
        the embedding goes with layer 0, the final norm and LM head with the last layer."""
        for i in layers:
            self.layers.pop(i, None)
        if 0 not in self.layers:
            self.embed_tokens = None
        if self.config.num_layers - 1 not in self.layers:
            self.final_norm = self.lm_head = None

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held (a tied LM head counted once)."""
        return StageParts(self.layers, self.embed_tokens, self.final_norm, self.lm_head).nbytes

    @property
    def holds_embedding(self) -> bool:
        return self.embed_tokens is not None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "embed() on a stage that does not hold layer 0"
        return F.embedding(token_ids.to(self.device), self.embed_tokens)

    def logits(self, hidden: torch.Tensor, tasks: task_ops.TaskRows | None = None) -> torch.Tensor:
        """Final norm + LM head on ``hidden`` rows ``[n, hidden_size]`` -> float32 CPU ``[n, vocab]``;
        ``tasks`` (rows of ``hidden``) add their BitFit biases of the final norm and the LM head."""
        assert self.final_norm is not None and self.lm_head is not None, "logits() on a non-last stage"
        if tasks is None:
            return self.lm_head(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)).to("cpu", torch.float32)
        normed = task_ops.add_head_biases(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), tasks, "norm")
        return task_ops.add_head_biases(self.lm_head(normed), tasks, "lm_head").to("cpu", torch.float32)

    def forward(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run the stage's layers on the flattened ``hidden`` ``[T, hidden_size]``; writes KV."""
        if self.device.type != "cuda":
            return self._forward(hidden, segments)
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS):
            return self._forward(hidden, segments)

    def _forward(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        positions = torch.cat([torch.arange(s.first_position, s.first_position + s.num_tokens) for s in segments])
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # once per step, shared by all layers
        cos, sin = cos.to(hidden.device, hidden.dtype), sin.to(hidden.device, hidden.dtype)
        sizes = [s.num_tokens for s in segments]
        tasks = task_ops.TaskRows.group(((s.task, s.rows) for s in segments), hidden.device) \
            if any(s.task is not None for s in segments) else None
        for layer in range(min(s.layer_start for s in segments), max(s.layer_end for s in segments)):
            active = [s for s in segments if s.layer_start <= layer < s.layer_end]
            if not active:
                continue
            if len(active) == len(segments):
                hidden = self._layer(layer, hidden, segments, sizes, cos, sin, tasks)
                continue
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in active]).to(hidden.device)
            packed, offset = [], 0
            for s in active:
                packed.append(Segment(slice(offset, offset + s.num_tokens), s.kv, s.first_position,
                                      s.layer_start, s.layer_end, s.task))
                offset += s.num_tokens
            packed_tasks = None if tasks is None else \
                task_ops.TaskRows.group(((s.task, s.rows) for s in packed), hidden.device)
            out = self._layer(layer, hidden[rows], packed, [s.num_tokens for s in packed], cos[rows], sin[rows],
                              packed_tasks)
            hidden = hidden.index_copy(0, rows, out)
        return hidden

    def _layer(self, layer: int, x: torch.Tensor, segments: list[Segment], sizes: list[int],
               cos: torch.Tensor, sin: torch.Tensor, tasks: task_ops.TaskRows | None = None) -> torch.Tensor:
        if tasks is not None and (deltas := tasks.at(layer)):
            return self._task_layer(layer, x, segments, sizes, cos, sin, deltas)
        cfg, w = self.config, self.layers[layer]
        h, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = w.qkv(rms_norm(x, w.input_norm, cfg.rms_norm_eps))
        qk = apply_rope(qkv[:, :(h + n_kv) * d].view(-1, h + n_kv, d), cos, sin)  # q and k in one go
        v = qkv[:, (h + n_kv) * d:].view(-1, n_kv, d)
        attn = self.attention(layer, segments, sizes, qk[:, :h], qk[:, h:], v)
        x = w.o_proj.add(attn, x)
        return w.down.add(silu_mul(w.gate_up(rms_norm(x, w.post_norm, cfg.rms_norm_eps))), x)

    def _task_layer(self, layer: int, x: torch.Tensor, segments: list[Segment], sizes: list[int],
                    cos: torch.Tensor, sin: torch.Tensor, deltas: task_ops.LayerRows) -> torch.Tensor:
        """:meth:`_layer` for a step with task rows: each shared op once over all rows, then the
        tasks' ops on their own rows (``deltas``: one group per task with ops in this layer)."""
        cfg, w = self.config, self.layers[layer]
        h, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        normed = task_ops.add_norm_biases(rms_norm(x, w.input_norm, cfg.rms_norm_eps), deltas, "input_layernorm")
        qkv = task_ops.add_site_deltas(w.qkv(normed), normed, deltas, "qkv")
        qk = apply_rope(qkv[:, :(h + n_kv) * d].view(-1, h + n_kv, d), cos, sin)
        v = qkv[:, (h + n_kv) * d:].view(-1, n_kv, d)
        attn = self.attention(layer, segments, sizes, qk[:, :h], qk[:, h:], v)
        x = task_ops.sublayer_with_residual(w.o_proj, attn, x, deltas, "o_proj", "attn_adapter")
        normed = task_ops.add_norm_biases(rms_norm(x, w.post_norm, cfg.rms_norm_eps), deltas, "post_attention_layernorm")
        gate_up = task_ops.add_site_deltas(w.gate_up(normed), normed, deltas, "gate_up")
        return task_ops.sublayer_with_residual(w.down, silu_mul(gate_up), x, deltas, "down", "mlp_adapter")


class StepAttention:
    """Attention of one layer over a step's segments, each request against its own KV cache.

    One-token decodes go to the native kernel in one call (float32 CPU), everything else to
    per-request SDPA. Shared by the torch stage and the vLLM backend (``node_agent.vllm_layers``).
    """

    __slots__ = ("num_heads", "head_dim")

    def __init__(self, num_heads: int, head_dim: int) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim

    def __call__(self, layer: int, segments: list[Segment], sizes: list[int], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]`` (rotated) -> ``[T, heads * d]``; writes KV."""
        kernels, decodes = self._native_decodes(segments, q)
        if decodes:
            return self._attend_decodes(kernels, layer, segments, decodes, q, k, v)
        if len(segments) == 1:
            return self._attend(layer, segments[0], q, k, v)
        qs, ks, vs = q.split(sizes), k.split(sizes), v.split(sizes)
        return torch.cat([self._attend(layer, s, *qkv) for s, *qkv in zip(segments, qs, ks, vs, strict=True)])

    def _native_decodes(self, segments: list[Segment], x: torch.Tensor) -> tuple[Any | None, list[int]]:
        """The native kernels and the indices of the one-token segments they take (none if unavailable)."""
        kernels = _native_for(x)
        if kernels is None:
            return None, []
        return kernels, [i for i, s in enumerate(segments) if s.num_tokens == 1 and s.kv.k.dtype == torch.float32]

    def _attend_decodes(self, kernels: Any, layer: int, segments: list[Segment], decodes: list[int],
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the step: its one-token decodes in one native call, other segments per request.

        ``segments`` cover the step's rows in order, so when every segment is a decode its rows are
        ``0..T-1`` and ``q``/``k``/``v`` go to the kernel as views, without a gather.
        """
        h, d = self.num_heads, self.head_dim
        dec = [segments[i] for i in decodes]
        for s in dec:
            s.kv.claim(s.first_position, 1)
        rows = None if len(dec) == len(segments) else torch.tensor([s.rows.start for s in dec])
        q_new, k_new, v_new = (q, k, v) if rows is None else (q[rows], k[rows], v[rows])
        attn = kernels.decode_attention(q_new, k_new, v_new, [s.kv.k for s in dec], [s.kv.v for s in dec],
                                        torch.tensor([s.first_position for s in dec]),
                                        torch.tensor([layer - s.kv.layer_start for s in dec]), d ** -0.5)
        if rows is None:
            return attn
        out = torch.empty(q.shape[0], h * d, dtype=q.dtype)
        out.index_copy_(0, rows, attn)
        native_rows = set(decodes)
        for i, s in enumerate(segments):
            if i not in native_rows:
                out[s.rows] = self._attend(layer, s, q[s.rows], k[s.rows], v[s.rows])
        return out

    @staticmethod
    def _attend(layer: int, seg: Segment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one request's new tokens (``q`` ``[n, heads, d]``) against its cached + new keys.

        Grouped-query attention without ``enable_gqa`` (which sends SDPA to its slow math path):
        a decode row folds the query heads of each KV head into that head's query rows; a prefill
        chunk repeats the KV heads explicitly. Either way, with 4-D inputs, SDPA takes its fused (flash) CPU kernel.
        """
        n, p0 = seg.num_tokens, seg.first_position
        keys, values = seg.kv.write(layer, p0, k.transpose(0, 1), v.transpose(0, 1))  # [kv_heads, L, d]
        kv_heads, heads, d = keys.shape[0], q.shape[1], q.shape[2]
        if n == 1:  # head j uses KV head j // group (transformers' repeat_kv order)
            out = F.scaled_dot_product_attention(q.view(1, kv_heads, heads // kv_heads, d), keys[None], values[None])
            return out.reshape(1, heads * d)
        if heads != kv_heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=0)
            values = values.repeat_interleave(heads // kv_heads, dim=0)
        qh = q.transpose(0, 1)[None]  # [1, heads, n, d]: 4-D, else CPU SDPA falls back to its math path
        if p0 == 0:
            out = F.scaled_dot_product_attention(qh, keys[None], values[None], is_causal=True)
        else:
            mask = torch.ones(n, p0 + n, dtype=torch.bool, device=q.device).tril(diagonal=p0)
            out = F.scaled_dot_product_attention(qh, keys[None], values[None], attn_mask=mask)
        return out[0].transpose(0, 1).reshape(n, -1)
