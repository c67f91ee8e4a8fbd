"""The task ops of one engine step, run for all of the step's tasks together.

In a step the base weights run once over every row (the shared op); these functions then add each
bound task's op (:class:`node_agent.stage_task.StageTask`) on that task's rows: :class:`TaskRows`
groups a step's rows by task (PetS's intra-task mini-batches), :func:`add_site_deltas` adds the
fused linears' deltas (every task's LoRA in one native ``lora_segments`` call where it can),
:func:`add_norm_biases` and :func:`add_head_biases` BitFit's norm and head biases, and
:func:`sublayer_with_residual` the bottleneck adapters. :mod:`node_agent.model` calls them only for
steps that hold a task's rows; a base-only step never enters here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from node_agent import native
from node_agent.kernels import Linear
from node_agent.stage_task import LayerDelta, Rows, StageTask


class TaskRows:
    """The rows of a step that belong to tasks, one group per task (PetS's intra-task mini-batches).

    Built once per step, and only when some request of the step has a task.
    """

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[StageTask, Rows]]) -> None:
        self.groups = groups

    @classmethod
    def group(cls, spans: Iterable[tuple[StageTask | None, slice]], device: torch.device) -> TaskRows | None:
        """Group each request's ``(task, rows)`` by task; ``None`` when no request has a task."""
        by_task: dict[StageTask, list[slice]] = {}
        for task, span in spans:
            if task is not None:
                by_task.setdefault(task, []).append(span)
        if not by_task:
            return None
        groups: list[tuple[StageTask, Rows]] = []
        for task, slices in by_task.items():
            merged = [slices[0]]
            for s in slices[1:]:
                if s.start == merged[-1].stop:
                    merged[-1] = slice(merged[-1].start, s.stop)
                else:
                    merged.append(s)
            rows: Rows = merged[0] if len(merged) == 1 else \
                torch.cat([torch.arange(s.start, s.stop) for s in merged]).to(device)
            groups.append((task, rows))
        return cls(groups)

    def at(self, layer: int) -> list[tuple[LayerDelta, Rows]]:
        """The tasks with ops in ``layer``, with their rows."""
        return [(task.layers[layer], rows) for task, rows in self.groups if layer in task.layers]


LayerRows = list[tuple[LayerDelta, Rows]]


def num_rows(rows: Rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def add_rows(y: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    """``y[rows] += delta`` in place."""
    if isinstance(rows, slice):
        y[rows] += delta
    else:
        y.index_add_(0, rows, delta)


def add_site_deltas(y: torch.Tensor, x: torch.Tensor, deltas: LayerRows, site: str) -> torch.Tensor:
    """``y[rows] += Δ(x[rows])`` for every task with an op on fused linear ``site``; returns ``y``.

    With the native kernels (float32 CPU rows), the LoRA terms of every task whose rows are one span
    go in one ``lora_segments`` call (Punica's SGMV: each task's ``A`` and ``B`` read in place, no
    weight gathered or copied); the rest (scattered rows, sparse deltas, biases) per task.
    """
    kernel = _lora_kernel(y, x)
    if kernel is None:
        for delta, rows in deltas:
            op = delta.sites.get(site)
            if op is not None:
                op.add_to(y, x, rows)
        return y
    a: list[torch.Tensor] = []
    b: list[torch.Tensor] = []
    segments: list[int] = []
    blocks: list[int] = []
    scales: list[float] = []
    for delta, rows in deltas:
        op = delta.sites.get(site)
        if op is None:
            continue
        if op.lora_a is None or not isinstance(rows, slice):
            op.add_to(y, x, rows)
            continue
        segments += (rows.start, rows.stop, len(b), len(op.lora_bs))
        a.append(op.lora_a)
        b += op.lora_bs
        blocks += op.lora_blocks
        scales += op.lora_scales
        if op.sparse is not None or op.bias is not None:
            op.add_to(y, x, rows, lora=False)
    if a:
        kernel(y, x, a, b, segments, blocks, scales)
    return y


def _lora_kernel(y: torch.Tensor, x: torch.Tensor) -> Callable[..., None] | None:
    """The native ``lora_segments`` op if it takes these rows (float32 CPU, contiguous rows), else ``None``."""
    if y.dtype != torch.float32 or x.dtype != torch.float32 or y.device.type != "cpu" or x.device.type != "cpu" \
            or y.dim() != 2 or x.dim() != 2 or y.stride(1) != 1 or x.stride(1) != 1:
        return None
    kernels = native.ops()
    return None if kernels is None else kernels.lora_segments


def add_norm_biases(normed: torch.Tensor, deltas: LayerRows, norm: str) -> torch.Tensor:
    """BitFit's ``norm(x)·g + b`` of the tasks with a bias on ``norm``; returns ``normed``."""
    for delta, rows in deltas:
        bias = delta.norm_bias.get(norm)
        if bias is not None:
            add_rows(normed, rows, bias.expand(num_rows(rows), -1))
    return normed


def sublayer_with_residual(linear: Linear, x: torch.Tensor, residual: torch.Tensor, deltas: LayerRows,
                           site: str, adapter_place: str) -> torch.Tensor:  # fmt: skip
    """``residual + linear(x) + Δ(x)``, with the adapters at ``adapter_place`` applied to
    ``linear(x) + Δ(x)`` first; without adapters the shared op keeps its fused residual add."""
    if not any(adapter_place in delta.adapters for delta, _ in deltas):
        return add_site_deltas(linear.add(x, residual), x, deltas, site)
    out = add_site_deltas(linear(x), x, deltas, site)
    for delta, rows in deltas:
        adapter = delta.adapters.get(adapter_place)
        if adapter is not None:
            add_rows(out, rows, adapter(out[rows]))
    return out.add_(residual)


def add_head_biases(y: torch.Tensor, tasks: TaskRows, which: str) -> torch.Tensor:
    """BitFit's final-norm (``which="norm"``) or LM-head (``"lm_head"``) bias on the tasks' rows."""
    for task, rows in tasks.groups:
        bias = task.final_norm_bias if which == "norm" else task.lm_head_bias
        if bias is not None:
            add_rows(y, rows, bias.expand(num_rows(rows), -1))
    return y
