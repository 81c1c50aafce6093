"""What a load hands on: the model with its dense weights, its expert layout and files, and the
steps both loaders (safetensors checkpoints, GGUF files) share to fill a model built on the meta
device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.checkpoint import CheckpointFiles
from engine.model.gguf.file import GGUFModel
from engine.model.layout import MoELayout
from engine.system.progress import ProgressFn

__all__ = ["LoadedWeights", "ProgressFn", "set_tensor", "tie_loaded"]


@dataclass
class LoadedWeights:
    model: torch.nn.Module
    layout: MoELayout
    files: CheckpointFiles
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)  # what was converted at load, for the user
    gguf: GGUFModel | None = None  # the GGUF file it was opened from
    text_only: bool = False  # a multimodal model of which the text part runs (images are a later step)


def tie_loaded(model: torch.nn.Module) -> None:
    """transformers' weight tying (`all_tied_weights_keys`, target -> source) for the weights the load
    left on the meta device: a tied LM head, DiffusionGemma's encoder running its decoder's layers.
    Not `model.tie_weights()`, which stops at the offloaded experts (their bytes live in the store)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:  # a remote-code class from before the mapping
        if getattr(model, "lm_head", None) is not None and model.lm_head.weight.is_meta:
            model.tie_weights()
        return
    for target, source in tied.items():
        parent_name, _, name = target.rpartition(".")
        parent = model.get_submodule(parent_name)
        current = getattr(parent, name, None)
        if not isinstance(current, torch.Tensor) or not current.is_meta:
            continue  # loaded from the checkpoint, or an offloaded expert weight
        value = model.get_parameter_or_buffer(source)
        if not value.is_meta:
            setattr(parent, name, value)


def set_tensor(model: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
    owner_path, _, name = key.rpartition(".")
    owner = model.get_submodule(owner_path)
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[name] = tensor
