"""The Llama-family decoder *stage*: layers ``[start, end)`` of a model, run on flattened tokens.

Selective batching (Orca): every linear op (QKV / O projections, MLP, norms) runs once on the
concatenated tokens of all requests in the step; attention runs per request against that
request's own KV cache. A request may carry a layer sub-range ``[a, b)`` inside the stage
(Helix's overlap resolution): at layer ``l`` only the rows of requests with ``a <= l < b`` are
computed, the rest pass through untouched. The stage that holds layer 0 owns the token
embedding; the stage that holds the last layer owns the final norm and the LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from node_agent.config import ModelConfig, RopeConfig
from node_agent.kv_cache import RequestKV
from node_agent.weights import EMBED, FINAL_NORM, LAYER_TENSORS, LM_HEAD


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@dataclass(slots=True)
class Segment:
    """One request's rows in a step: ``rows`` of the flattened batch, its KV, its layer sub-range."""

    rows: slice
    kv: RequestKV
    first_position: int
    layer_start: int
    layer_end: int

    @property
    def num_tokens(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # fused [q; k; v] rows
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # fused [gate; up] rows
    down: torch.Tensor


class StageModel:
    """Weights + forward math of layers ``[start, end)``; holds no per-request state."""

    def __init__(self, config: ModelConfig, start: int, end: int, tensors: dict[str, torch.Tensor]) -> None:
        self.config, self.start, self.end = config, start, end
        self.layers: dict[int, LayerWeights] = {}
        for i in range(start, end):
            t = {name: tensors[f"model.layers.{i}.{name}"] for name in LAYER_TENSORS}
            self.layers[i] = LayerWeights(
                input_norm=t["input_layernorm.weight"],
                qkv=torch.cat([t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"],
                               t["self_attn.v_proj.weight"]]),
                o_proj=t["self_attn.o_proj.weight"],
                post_norm=t["post_attention_layernorm.weight"],
                gate_up=torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]),
                down=t["mlp.down_proj.weight"],
            )
        self.embed_tokens = tensors[EMBED] if start == 0 else None
        self.is_last = end == config.num_layers
        self.final_norm = tensors[FINAL_NORM] if self.is_last else None
        self.lm_head = (tensors[EMBED] if config.tie_word_embeddings else tensors[LM_HEAD]) if self.is_last else None
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)

    @property
    def holds_embedding(self) -> bool:
        return self.embed_tokens is not None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "embed() on a stage that does not hold layer 0"
        return F.embedding(token_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on ``hidden`` rows ``[n, hidden_size]`` -> ``[n, vocab]``."""
        assert self.final_norm is not None and self.lm_head is not None, "logits() on a non-last stage"
        return F.linear(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)

    def forward(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run the stage's layers on the flattened ``hidden`` ``[T, hidden_size]``; writes KV."""
        for layer in range(self.start, self.end):
            active = [s for s in segments if s.layer_start <= layer < s.layer_end]
            if not active:
                continue
            if len(active) == len(segments):
                hidden = self._layer(layer, hidden, segments)
                continue
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in active])
            packed, offset = [], 0
            for s in active:
                packed.append(Segment(slice(offset, offset + s.num_tokens), s.kv, s.first_position,
                                      s.layer_start, s.layer_end))
                offset += s.num_tokens
            hidden = hidden.index_copy(0, rows, self._layer(layer, hidden[rows], packed))
        return hidden

    def _layer(self, layer: int, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        cfg, w = self.config, self.layers[layer]
        n_q, n_kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        qkv = F.linear(rms_norm(x, w.input_norm, cfg.rms_norm_eps), w.qkv)
        q = qkv[:, :n_q].view(-1, cfg.num_heads, d)
        k = qkv[:, n_q:n_q + n_kv].view(-1, cfg.num_kv_heads, d)
        v = qkv[:, n_q + n_kv:].view(-1, cfg.num_kv_heads, d)
        positions = torch.cat([torch.arange(s.first_position, s.first_position + s.num_tokens) for s in segments])
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        outs = [self._attend(layer, s, q[s.rows], k[s.rows], v[s.rows]) for s in segments]
        x = x + F.linear(torch.cat(outs), w.o_proj)
        gate, up = F.linear(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down)

    def _attend(self, layer: int, seg: Segment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one request's new tokens against its cached + new keys."""
        n, p0 = seg.num_tokens, seg.first_position
        keys, values = seg.kv.write(layer, p0, k.transpose(0, 1), v.transpose(0, 1))
        qh = q.transpose(0, 1)  # [heads, n, d]
        if n == 1:
            out = F.scaled_dot_product_attention(qh, keys, values, enable_gqa=True)
        elif p0 == 0:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(n, p0 + n, dtype=torch.bool).tril(diagonal=p0)
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1).reshape(n, -1)
