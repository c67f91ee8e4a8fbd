"""The native decode-attention kernel against PyTorch's SDPA, and its input checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """SDPA per request: q [B, H, D]; keys[b] / values[b] [KVH, L_b, D] (KV head = head // group)."""
    outs = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        outs.append(F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0].reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (4, 1, 24)])
def test_decode_attention_matches_sdpa_and_writes_the_new_row(heads: int, kv_heads: int, head_dim: int,
                                                              native_ops: Any) -> None:
    op = native_ops.decode_attention
    gen = torch.Generator().manual_seed(heads * head_dim)
    positions = [0, 5, 37, 130]  # the first token of a request attends to itself only
    caches_k = [torch.randn(3, kv_heads, p + 4, head_dim, generator=gen) for p in positions]
    caches_v = [torch.randn(3, kv_heads, p + 4, head_dim, generator=gen) for p in positions]
    before_k = [c.clone() for c in caches_k]
    # q / k_new / v_new as the model passes them: strided views of one [B, H + KVH, D] tensor
    qk = torch.randn(len(positions), heads + kv_heads, head_dim, generator=gen)
    v_new = torch.randn(len(positions), kv_heads, head_dim, generator=gen)
    layers = [2, 0, 1, 2]
    out = op(qk[:, :heads], qk[:, heads:], v_new, caches_k, caches_v, torch.tensor(positions),
             torch.tensor(layers), head_dim ** -0.5)
    for b, (p, layer) in enumerate(zip(positions, layers, strict=True)):
        torch.testing.assert_close(caches_k[b][layer, :, p], qk[b, heads:])
        torch.testing.assert_close(caches_v[b][layer, :, p], v_new[b])
        untouched = before_k[b].clone()
        untouched[layer, :, p] = qk[b, heads:]
        torch.testing.assert_close(caches_k[b], untouched)  # nothing else written
    ref = _reference(qk[:, :heads], [c[layer, :, : p + 1] for c, p, layer in zip(caches_k, positions, layers, strict=True)],
                     [c[layer, :, : p + 1] for c, p, layer in zip(caches_v, positions, layers, strict=True)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_rejects_a_position_outside_the_reservation(native_ops: Any) -> None:
    op = native_ops.decode_attention
    k, v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="position out of the reserved KV"):
        op(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), [k], [v], torch.tensor([4]),
           torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="float32 only"):
        op(torch.zeros(1, 1, 8, dtype=torch.float64), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), [k], [v],
           torch.tensor([0]), torch.tensor([0]), 1.0)


def test_disabled_kernel_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent import native

    monkeypatch.setenv("HELIX_NATIVE", "0")
    assert native.ops() is None
    assert native.unavailable_reason() == "disabled by HELIX_NATIVE=0"


def test_rms_norm_and_silu_mul_match_pytorch(native_ops: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * 96, generator=gen)[:, :96]  # strided rows, as a slice of a wider tensor
    weight = torch.randn(96, generator=gen)
    torch.testing.assert_close(native_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5))
    gate_up = torch.randn(5, 2 * 40, generator=gen) * 8  # large |x|: exp over- and underflows
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native_ops.silu_mul(gate_up), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="rms_norm: weight must be float32"):
        native_ops.rms_norm(x, torch.randn(95), 1e-5)


def test_a_failed_build_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    from node_agent import native

    def no_compiler(**_: Any) -> None:
        raise RuntimeError("Error building extension 'helix_native'\nc++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.delenv("HELIX_NATIVE", raising=False)
    assert native._load.__wrapped__() is None  # the uncached loader: the process's loaded library stays
    assert native.unavailable_reason() == "RuntimeError: c++: not found"
    monkeypatch.setattr(native, "_unavailable_reason", None)
