"""The layers a stage holds while they change (issue 18): what a new range lacks, what loading it
takes, and its weights built off the engine thread.

An agent given a new range ``[c, d)`` while it serves asks :func:`missing` what its model lacks
(layers, the embedding with layer 0, the final norm and LM head with the last layer), checks the
bytes that will take (:func:`load_nbytes`, from the checkpoint's headers alone) against its
memory, builds the weights on a loader thread (:func:`build_layers`, which touches no engine
state) and hands them to :meth:`node_agent.engine.StageEngine.insert_layers` between two steps.
Ranges are :class:`helix.domain.LayerRange`; a stage's layers as ranges: :func:`spans`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from helix.domain import LayerRange
from node_agent.config import ModelConfig
from node_agent.model import StageModel, StageParts, build_parts
from node_agent.weights import load_tensors, tensor_names, tensors_nbytes


@dataclass(frozen=True, slots=True)
class LayerLoad:
    """What a stage lacks of a range it is to hold: these layers, and the embedding / the head."""

    layers: tuple[int, ...]
    embed: bool
    head: bool

    def __bool__(self) -> bool:
        return bool(self.layers or self.embed or self.head)

    def names(self, config: ModelConfig) -> list[str]:
        return tensor_names(config, self.layers, embed=self.embed, head=self.head)


def spans(layers: Iterable[int]) -> tuple[LayerRange, ...]:
    """``layers`` as ascending ranges, each as long as it can be."""
    out: list[LayerRange] = []
    for i in sorted(layers):
        if out and out[-1].end == i:
            out[-1] = LayerRange(out[-1].start, i + 1)
        else:
            out.append(LayerRange(i, i + 1))
    return tuple(out)


def describe_spans(held: Iterable[LayerRange]) -> str:
    return " ".join(r.describe() for r in held) or "none"


def missing(model: StageModel, start: int, end: int) -> LayerLoad:
    """What ``model`` lacks to hold ``[start, end)`` too."""
    return LayerLoad(tuple(i for i in range(start, end) if i not in model.layers),
                     start == 0 and model.embed_tokens is None,
                     end == model.config.num_layers and model.lm_head is None)  # fmt: skip


def load_nbytes(model: StageModel, model_dir: str | Path, load: LayerLoad) -> int:
    """Bytes ``load``'s weights will take in ``model``'s dtype (from the checkpoint's headers)."""
    return tensors_nbytes(model_dir, load.names(model.config), torch.empty((), dtype=model.dtype).element_size())


def kv_bytes_per_token_layer(model: StageModel) -> int:
    """Bytes one token's K and V take in one layer of ``model``."""
    cfg = model.config
    return 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=model.dtype).element_size()


def build_layers(model: StageModel, model_dir: str | Path, load: LayerLoad) -> StageParts:
    """Read and build ``load``'s weights for ``model`` (its dtype and device). Reads only ``model``'s
    config, dtype and device: run it off the engine thread."""
    tensors = load_tensors(model_dir, load.names(model.config))
    return build_parts(model.config, load.layers, tensors, embed=load.embed, head=load.head, dtype=model.dtype,
                       device=model.device)  # fmt: skip
