"""Fine-tuned tasks on disk: the cluster file's ``tasks:`` entries and a task directory's descriptor.

A *task* is a name, the base model it fine-tunes (the cluster's model), a PET type and its
parameters, kept in one directory (docs/pets.md):

* **LoRA in PEFT's format**: ``adapter_config.json`` + ``adapter_model.safetensors``, as
  ``peft``'s ``save_pretrained`` writes them (:class:`PeftLoraConfig` reads the fields that
  matter: rank, alpha, rsLoRA, the per-module rank and alpha patterns).
* **Every type in Helix's layout**: ``helix_pet.json`` (:class:`PETFileConfig`: the type and
  its few settings) + ``pet_model.safetensors``, the tensors named as in
  :mod:`node_agent.pets` (sparse ones as ``NAME.indices`` ``[2, nnz]`` + ``NAME.values``).

This module is pure (json and pydantic): the coordinator reads a directory's descriptor with it
to refuse a bad path or config before any agent is asked, and each agent reads the same
descriptor before it loads the tensors of its own layers (:mod:`node_agent.task_files`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from helix.errors import PETError
from helix.loading import format_loc

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PET_CONFIG, PET_WEIGHTS = "helix_pet.json", "pet_model.safetensors"
PET_TYPES = ("lora", "adapter", "bitfit", "diff", "mask")
PETTypeName = Literal["lora", "adapter", "bitfit", "diff", "mask"]
M = TypeVar("M", bound=BaseModel)
TASK_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"  # what a client may put in "model"
MAX_DIFF_DENSITY = 0.01  # a Diff-Pruning delta is >= 99 % zeros (PetS's default: 99.5 %)
MAX_MASK_COMPLEMENT_DENSITY = 0.05  # a mask zeroes at most 5 % of a weight (PetS's MaskBert: 95 % sparse)


class TaskSpec(BaseModel):
    """A fine-tuned task served from start (the cluster file's `tasks:`; more can be loaded at runtime)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TASK_NAME_PATTERN,
                      description='what clients send as `"model"` to use the task: letters, digits and `._:/@+-`, at most '
                      "128 characters; unique, not the base model's name")
    path: str = Field(min_length=1, description="the task's directory (PEFT's LoRA files or Helix's layout, "
                                                "docs/pets.md), relative to the cluster file; every agent reads it")


class PETFileConfig(BaseModel):
    """`helix_pet.json`, the descriptor of a task in Helix's layout (beside `pet_model.safetensors`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pet_type: PETTypeName = Field(description="the PET: lora, adapter, bitfit, diff or mask")
    base_model: str | None = Field(default=None, description="informational: the base model the task fine-tunes")
    adapter_activation: Literal["relu", "gelu", "gelu_tanh", "silu", "swish", "tanh"] = Field(
        default="relu", description="adapter only: the bottleneck's activation")
    lora_scaling: float = Field(default=1.0, description="lora only: the scale `s` of every module's `x·A·B·s`")


class PeftLoraConfig(BaseModel):
    """The fields of PEFT's ``adapter_config.json`` that decide how Helix runs a LoRA; the others are
    accepted and ignored, except those naming something Helix does not run (DoRA, biases, extra modules)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peft_type: Literal["LORA"] = "LORA"
    r: int = Field(default=8, ge=1)
    lora_alpha: float = 8
    use_rslora: bool = False
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    base_model_name_or_path: str | None = None
    use_dora: Literal[False] = False
    bias: Literal["none"] = "none"
    modules_to_save: None | list[str] = None

    def scaling(self, module_key: str) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) for ``model.layers.{i}.{module}``, PEFT's
        patterns matched the way PEFT matches them (a pattern matches a key's dotted suffix)."""
        rank = _pattern_value(self.rank_pattern, module_key, self.r)
        alpha = _pattern_value(self.alpha_pattern, module_key, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(patterns: dict[str, float] | dict[str, int], key: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


@dataclass(frozen=True, slots=True)
class TaskDescriptor:
    """What a task directory holds: the PET type, its weights file and its settings."""

    directory: Path
    pet_type: str
    weights: Path
    peft: PeftLoraConfig | None = None  # PEFT's LoRA
    ours: PETFileConfig | None = None  # Helix's layout

    @property
    def base_model(self) -> str | None:
        return self.peft.base_model_name_or_path if self.peft is not None else self.ours.base_model if self.ours else None


def read_descriptor(path: str | Path) -> TaskDescriptor:
    """The descriptor of the task directory ``path``; a :class:`PETError` naming the file otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise PETError(f"not a directory (a task is a directory holding {PEFT_CONFIG} + {PEFT_WEIGHTS}, or "
                       f"{PET_CONFIG} + {PET_WEIGHTS})", source=str(directory))  # fmt: skip
    peft_file, ours_file = directory / PEFT_CONFIG, directory / PET_CONFIG
    if ours_file.is_file():
        ours = _read(ours_file, PETFileConfig)
        weights = directory / PET_WEIGHTS
        descriptor = TaskDescriptor(directory, ours.pet_type, weights, ours=ours)
    elif peft_file.is_file():
        peft = _read(peft_file, PeftLoraConfig)
        weights = directory / PEFT_WEIGHTS
        descriptor = TaskDescriptor(directory, "lora", weights, peft=peft)
    else:
        raise PETError(f"holds neither {PEFT_CONFIG} (PEFT's LoRA) nor {PET_CONFIG} (Helix's layout)",
                       source=str(directory))  # fmt: skip
    if not weights.is_file():
        raise PETError("file not found (the task's tensors)", source=str(weights))
    return descriptor


def _read(file: Path, model: type[M]) -> M:
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PETError(f"not a readable JSON file ({exc})", source=str(file)) from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = format_loc(tuple(first["loc"]))
        raise PETError(f"{where + ': ' if where else ''}{first['msg']} (got {first.get('input')!r})",
                       source=str(file)) from None
