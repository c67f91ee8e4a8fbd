"""The memory a cluster's fine-tuned tasks take on the nodes, and what it leaves of their KV and layers.

Every task of the cluster file's ``tasks:`` (docs/pets.md) is held by every node, for the layers the
node holds. :func:`task_memory` reads each task's safetensors *header* (8 bytes of length, then the
JSON of names, dtypes and shapes: no tensor is read) and counts the bytes a stage holds for it, per
layer, by the rule below; the final norm's and the LM head's BitFit biases count on the last layer.

========================================  =============================================================
tensor in the file                         bytes a stage holds (``d`` = the model profile's ``dtype_bytes``)
========================================  =============================================================
dense (LoRA A/B, adapters, biases)         ``elements * d`` (a stage holds them in its own dtype)
sparse ``NAME.indices`` ``[2, nnz]``       ``nnz * 8`` (CSR: a float32 value + an int32 column index;
                                           the row pointers, a few KB per linear, are left out)
sparse ``NAME.values``                     0 (counted with its indices)
dense ``weight_mask`` / ``weight_diff``    ``elements * max density * 8`` (at most 5 % / 1 % of a
                                           weight is held, sparse: the header does not say how much)
========================================  =============================================================

:meth:`TaskMemory.held` is the most any ``k`` consecutive layers need (what a node holding ``k``
layers must find room for, wherever they lie). :func:`charged` takes it out of a GPU type's
profile, as the layer limit takes the weights (docs/profiler.md)::

    kv'(k) = kv(k) - held(k) / kv_bytes_per_token_per_layer           KV entries left next to k layers
    max_layers' = the largest k <= max_layers with kv'(k) > r * k

``r`` is the least KV per layer the profile's reserve can keep: a profile that stops at ``M``
layers short of the model's says ``M + 1`` layers would leave less than its reserve, so
``r = kv(M + 1) / (M + 1)`` (``kv(M + 1)`` from the list, or one more layer's weights taken from
``kv(M)``; 0 when negative or when ``M`` is the whole model). A ``tok_s`` table is cut to the new
limit; a profile without ``kv_capacity_tokens_by_layers`` is left as it is (its KV is the planner's
estimate from ``vram_gb``). :func:`with_task_memory` charges every GPU type's profile of the cluster's
model; ``helix.profile.load_profiles_for`` applies it, so the planner, the simulator and the router
see the same nodes. A cluster without tasks gets its profiles back unchanged (the same object).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helix.errors import InfeasiblePlanError, PETError
from helix.spec import ClusterSpec
from helix.tasks import (
    MAX_DIFF_DENSITY,
    MAX_MASK_COMPLEMENT_DENSITY,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    PET_CONFIG,
    PET_WEIGHTS,
    read_descriptor,
)

if TYPE_CHECKING:  # helix.profile applies this module; the types only are needed here
    from helix.profile import ModelProfile, ProfileSet, ThroughputProfile

SPARSE_ENTRY_BYTES = 8  # one non-zero on a stage: a float32 value and an int32 column index (CSR)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TaskMemory:
    """The PET bytes of a cluster's tasks: per layer, and how many tasks of each PET type."""

    layer_bytes: tuple[float, ...]  # every task's bytes in layer i, summed (the head's biases on the last)
    pet_types: dict[str, int]  # PET type -> tasks of that type (the planner's and simulator's task mix)

    @property
    def tasks(self) -> int:
        return sum(self.pet_types.values())

    def held(self, layers: int) -> float:
        """The most bytes any ``layers`` consecutive layers' PETs take."""
        b = self.layer_bytes
        if layers <= 0:
            return 0.0
        if layers >= len(b):
            return float(sum(b))
        window = best = sum(b[:layers])
        for i in range(layers, len(b)):
            window += b[i] - b[i - layers]
            best = max(best, window)
        return float(best)


def task_memory(cluster: ClusterSpec, num_layers: int, dtype_bytes: int) -> TaskMemory | None:
    """The memory of the cluster's ``tasks:`` (None without tasks); a :class:`PETError` naming the
    file for a directory or header that cannot be read."""
    if not cluster.tasks:
        return None
    total = [0.0] * num_layers
    types: dict[str, int] = {}
    for _, path in cluster.task_paths():
        pet_type, per_layer = pet_layer_bytes(path, num_layers, dtype_bytes)
        types[pet_type] = types.get(pet_type, 0) + 1
        for i, b in enumerate(per_layer):
            total[i] += b
    return TaskMemory(tuple(total), types)


def pet_layer_bytes(directory: str, num_layers: int, dtype_bytes: int) -> tuple[str, tuple[float, ...]]:
    """One task directory's PET type and the bytes a stage holds for it in each layer (module docstring)."""
    d = Path(directory)
    stamps = tuple(_stamp(d / name) for name in (PET_CONFIG, PET_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS))
    return _layer_bytes(str(d), stamps, num_layers, dtype_bytes)


def _stamp(file: Path) -> tuple[int, int] | None:
    try:
        stat = file.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=4096)
def _layer_bytes(directory: str, _stamps: tuple[tuple[int, int] | None, ...], num_layers: int,
                 dtype_bytes: int) -> tuple[str, tuple[float, ...]]:  # fmt: skip
    """Cached by the directory and its files' modification times and sizes: a cluster listing one
    directory under many names (or a plan run after another) reads it once."""
    descriptor = read_descriptor(directory)
    file = str(descriptor.weights)
    out = [0.0] * num_layers
    for name, info in _header(descriptor.weights).items():
        if name == "__metadata__":
            continue
        match = _LAYER.search(name)
        layer = num_layers - 1 if match is None else int(match[1])  # the head's biases: on the last layer
        if layer >= num_layers:
            raise PETError(f"layer {layer} is outside the base model's {num_layers} layers", tensor=name, source=file)
        out[layer] += _held_bytes(name, info.get("shape", []), dtype_bytes)
    return descriptor.pet_type, tuple(out)


def _held_bytes(name: str, shape: list[int], dtype_bytes: int) -> float:
    elements = math.prod(shape)
    if name.endswith(".indices"):
        return float(shape[-1] * SPARSE_ENTRY_BYTES) if shape else 0.0
    if name.endswith(".values"):
        return 0.0
    if name.endswith(".weight_mask"):
        return elements * MAX_MASK_COMPLEMENT_DENSITY * SPARSE_ENTRY_BYTES
    if name.endswith(".weight_diff"):
        return elements * MAX_DIFF_DENSITY * SPARSE_ENTRY_BYTES
    return float(elements * dtype_bytes)


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    try:
        with file.open("rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= MAX_HEADER_BYTES:
                raise PETError("not a safetensors file (no header length in its first 8 bytes)", source=str(file))
            header = json.loads(f.read(size))
    except OSError as exc:
        raise PETError(f"cannot be read ({exc.strerror or exc})", source=str(file)) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PETError("not a safetensors file (its header is not JSON)", source=str(file)) from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise PETError("not a safetensors file (its header is not a map of tensors)", source=str(file))
    return header


def charged(tp: ThroughputProfile, model: ModelProfile, memory: TaskMemory, gpu: str) -> ThroughputProfile:
    """``tp`` with the tasks' memory taken out of its KV and layer limit (module docstring); an
    :class:`InfeasiblePlanError` when not one layer fits beside the tasks."""
    kv = tp.kv_capacity_tokens_by_layers
    if kv is None:
        return tp
    kv_b, top = model.kv_bytes_per_token_per_layer, tp.max_layers
    left = [entries - memory.held(k) / kv_b for k, entries in enumerate(kv, start=1)]
    reserve = 0.0
    if top < model.num_layers:
        after = kv[top] if len(kv) > top else kv[top - 1] - model.layer_weight_bytes / kv_b
        reserve = max(0.0, after / (top + 1))
    fits = [k for k in range(1, top + 1) if left[k - 1] > reserve * k]
    if not fits:
        raise InfeasiblePlanError(
            f"the cluster's {memory.tasks} tasks' PETs take {memory.held(1) / 1e9:.3f} GB in one layer, more than "
            f"GPU type {gpu} keeps for KV beside one layer ({kv[0] * kv_b / 1e9:.3f} GB): serve fewer tasks, or "
            "give the GPU more memory (docs/pets.md)"
        )
    limit = fits[-1]
    update: dict[str, Any] = {"max_layers": limit, "kv_capacity_tokens_by_layers": left}
    if tp.tok_s is not None:
        update["tok_s"] = tp.tok_s[:limit]
    return tp.model_copy(update=update)


def with_task_memory(profiles: ProfileSet, cluster: ClusterSpec) -> ProfileSet:
    """``profiles`` with every GPU type's profile of the cluster's model charged for the cluster's
    tasks (:func:`charged`); the same object without tasks or without the model's constants."""
    model = profiles.models.get(cluster.model)
    if not cluster.tasks or model is None:
        return profiles
    memory = task_memory(cluster, model.num_layers, model.dtype_bytes)
    assert memory is not None
    used = {n.gpu for n in cluster.nodes}
    gpus = dict(profiles.gpus)
    for name, gpu in profiles.gpus.items():
        tp = gpu.throughput.get(cluster.model)
        if tp is not None and name in used:
            gpus[name] = gpu.model_copy(update={"throughput": {**gpu.throughput,
                                                               cluster.model: charged(tp, model, memory, name)}})
    return profiles.model_copy(update={"gpus": gpus})
