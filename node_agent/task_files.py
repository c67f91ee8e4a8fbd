"""Reading a task's PET from its directory, only the layers a stage holds; writing Helix's layout.

A task directory (:mod:`helix.tasks`, docs/pets.md) holds PEFT's LoRA files or Helix's layout.
:func:`load_task_slice` opens the safetensors file lazily (``safe_open``: only the header is read
up front) and reads only the tensors of layers ``[start, end)`` (and the final-norm / LM-head
biases when the stage ends the model), so an agent never holds the rest of a task. Every problem
is a :class:`~helix.errors.PETError` naming the file and the tensor. :func:`save_pet` writes
Helix's layout from tensors named as in :mod:`node_agent.pets` (sparse tensors as
``NAME.indices`` + ``NAME.values``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helix.errors import PETError
from helix.tasks import PET_CONFIG, PET_WEIGHTS, PETFileConfig, TaskDescriptor, read_descriptor
from node_agent.config import ModelConfig
from node_agent.pets import FINAL_NORM_BIAS, LM_HEAD_BIAS, TaskPET, lora_tensors_from_peft, module_shape

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_SPARSE_PART = re.compile(r"(.+\.(?:weight_diff|weight_mask_complement))\.(indices|values)")


def load_task_slice(path: str | Path, config: ModelConfig, start: int, end: int) -> tuple[TaskDescriptor, TaskPET]:
    """The task in directory ``path``, only its layers in ``[start, end)`` of the base ``config``.

    Tensor names are checked against the whole base (a layer past the model is an error even when
    this stage would not hold it); the shapes and values of the layers read are checked when the
    slice is bound (``StageEngine.add_task``), each error naming the file through :func:`in_file`.
    """
    descriptor = read_descriptor(path)
    source = str(descriptor.weights)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(source, framework="pt") as weights:  # type: ignore[no-untyped-call]
            for stored in weights.keys():
                name = _our_name(descriptor, stored, source)
                match = _LAYER.match(name)
                if match is not None:
                    layer = int(match[1])
                    if layer >= config.num_layers:
                        raise PETError(f"layer {layer} is outside the base model's {config.num_layers} layers",
                                       tensor=stored, source=source)  # fmt: skip
                    if not start <= layer < end:
                        continue
                elif name in (FINAL_NORM_BIAS, LM_HEAD_BIAS):
                    if end != config.num_layers:
                        continue
                tensors[name] = weights.get_tensor(stored)
    except PETError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a bad header or file
        raise PETError(f"not a readable safetensors file ({type(exc).__name__}: {exc})", source=source) from None
    with in_file(source):
        tensors = _assemble_sparse(tensors, config, descriptor.pet_type)
        if descriptor.peft is not None:
            peft = descriptor.peft
            scaling = {name.rpartition(".")[0]: peft.scaling(name.rpartition(".")[0]) for name in tensors}
            return descriptor, TaskPET.from_tensors("lora", tensors, lora_scaling=scaling)
        ours = descriptor.ours
        assert ours is not None
        return descriptor, TaskPET.from_tensors(ours.pet_type, tensors, lora_scaling=ours.lora_scaling,
                                                adapter_activation=ours.adapter_activation)  # fmt: skip


class in_file:  # noqa: N801 - used as a lowercase context manager
    """Re-raise a :class:`PETError` without a file with ``source`` as its file."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, PETError) and exc.source is None:
            raise PETError(exc.detail, tensor=exc.tensor, source=self.source) from None


def _our_name(descriptor: TaskDescriptor, stored: str, source: str) -> str:
    if descriptor.peft is None:
        return stored
    try:
        (name,) = lora_tensors_from_peft({stored: torch.empty(0)})
    except PETError as exc:
        raise PETError(exc.detail, tensor=stored, source=source) from None
    return name


def _assemble_sparse(tensors: dict[str, torch.Tensor], config: ModelConfig, pet_type: str) -> dict[str, torch.Tensor]:
    """``NAME.indices`` + ``NAME.values`` -> one sparse COO tensor ``NAME`` of the module's shape
    (a mask complement needs no values: every listed entry is zeroed)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _SPARSE_PART.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            parts.setdefault(match[1], {})[match[2]] = tensor
    for name, part in parts.items():
        if "indices" not in part:
            raise PETError("has values but no indices", tensor=f"{name}.values")
        indices = part["indices"]
        is_mask = name.endswith("weight_mask_complement")
        values = part.get("values")
        if values is None:
            if not is_mask:
                raise PETError("has indices but no values", tensor=f"{name}.indices")
            values = torch.ones(indices.shape[-1] if indices.dim() == 2 else 0, dtype=torch.bool)
        module = name.split(".", 3)[3].rpartition(".")[0]
        try:
            shape = module_shape(config, module)
        except KeyError:
            raise PETError(f"not a tensor of a {pet_type} PET (no linear module {module!r})",
                           tensor=f"{name}.indices") from None  # fmt: skip
        if indices.dim() != 2 or indices.shape[0] != 2 or indices.is_floating_point():
            raise PETError(f"shape {list(indices.shape)} {indices.dtype} is not [2, nnz] integer (row, column) "
                           f"indices", tensor=f"{name}.indices")  # fmt: skip
        if values.shape != (indices.shape[1],):
            raise PETError(f"shape {list(values.shape)} does not match its {indices.shape[1]} indices",
                           tensor=f"{name}.values")  # fmt: skip
        rows, cols = indices[0].long(), indices[1].long()
        if indices.numel() and not (0 <= int(rows.min()) and int(rows.max()) < shape[0]
                                    and 0 <= int(cols.min()) and int(cols.max()) < shape[1]):  # fmt: skip
            raise PETError(f"indices outside the base weight's shape {list(shape)} (a mask or delta of the wrong "
                           f"size)", tensor=f"{name}.indices")  # fmt: skip
        out[name] = torch.sparse_coo_tensor(torch.stack([rows, cols]), values, shape, check_invariants=True).coalesce()
    return out


def save_pet(directory: str | Path, pet_type: str, tensors: Mapping[str, torch.Tensor], *,
             base_model: str | None = None, adapter_activation: str = "relu", lora_scaling: float = 1.0) -> Path:
    """Write a task in Helix's layout (``helix_pet.json`` + ``pet_model.safetensors``); returns the directory.

    ``tensors`` are named as in :mod:`node_agent.pets`; sparse ones (a diff's ``weight_diff``, a
    mask's ``weight_mask_complement``) are stored as ``NAME.indices`` ``[2, nnz]`` int64 and
    ``NAME.values`` (none for a mask complement).
    """
    config = PETFileConfig.model_validate({"pet_type": pet_type, "base_model": base_model,
                                           "adapter_activation": adapter_activation, "lora_scaling": lora_scaling})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.layout == torch.strided:
            flat[name] = tensor.contiguous()
            continue
        coo = tensor.to_sparse_coo().coalesce() if tensor.layout != torch.sparse_coo else tensor.coalesce()
        flat[f"{name}.indices"] = coo.indices().contiguous()
        if not name.endswith("weight_mask_complement"):
            flat[f"{name}.values"] = coo.values().contiguous()
    save_file(flat, str(out / PET_WEIGHTS))
    (out / PET_CONFIG).write_text(json.dumps(config.model_dump(exclude_none=True), indent=2) + "\n")
    return out
