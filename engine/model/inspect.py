"""A model's MoE geometry and memory needs, read without loading any weights."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import torch

from engine.formats.blocks import BlockFormat, format_name
from engine.model.checkpoint import CheckpointFiles
from engine.model.layout import MoELayout, quantized_params
from engine.system.memory import resident_bytes


@dataclass
class ModelInfo:
    name: str
    path: str
    architecture: str
    num_moe_layers: int
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert, in its format (the compute dtype unless quantized)
    all_expert_bytes: int
    dense_bytes: int
    min_budget_bytes: int
    max_budget_bytes: int
    dtype: str
    device: str
    store: str
    context_length: int
    expert_format: str = "original"
    # the engine process by itself (interpreter, torch, transformers, code, tokenizer): measured by a
    # loaded runtime (engine.system.memory.EngineOverhead) or, for `moescope info`, its own process
    engine_overhead_bytes: int = 0
    text_only: bool = False  # a multimodal model of which the text part runs (images are a later step)


def host_tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's own parameters and buffers resident in this process's memory (on the
    CPU), each storage once: its dense weights as they sit now (quantized or not); the experts are on
    the meta device and their slots belong to the cache. Resident, not mapped: an input embedding
    left in the checkpoint's mapping holds only the rows read so far."""
    return sum(resident_bytes(address, nbytes) for address, nbytes in cpu_storages(model.parameters(),
                                                                                    model.buffers()).items())


def cpu_storages(*tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Address -> bytes of each CPU storage under `tensors`, once however many tensors share it."""
    seen: dict[int, int] = {}
    for tensor in chain(*tensors):
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return seen


def describe(files: CheckpointFiles, layout: MoELayout, config, dtype: torch.dtype, device: str, store: str,
             text_only: bool = False) -> ModelInfo:
    cfg = files.config
    return ModelInfo(
        name=files.root.name,
        path=str(files.root),
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        num_moe_layers=layout.num_layers,
        num_layers=int(getattr(config.get_text_config(), "num_hidden_layers", layout.num_layers)),
        num_experts=layout.num_experts,
        top_k=layout.top_k,
        expert_bytes=layout.slot_bytes,
        all_expert_bytes=layout.all_expert_bytes,
        dense_bytes=layout.dense_bytes,
        min_budget_bytes=layout.min_budget_bytes,
        max_budget_bytes=layout.all_expert_bytes,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        store=store,
        context_length=int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0),
        expert_format=format_name(layout.expert_format),
        text_only=text_only,
    )


def inspect_checkpoint(path: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False,
                       expert_format: BlockFormat | None = None) -> ModelInfo:
    """Sizes from headers only; with `expert_format`, the experts' bytes in that format (nothing is
    converted)."""
    from engine.model.loader import build_model

    # Dense weights go to the meta device: nothing but headers is read.
    loaded = build_model(path, device=torch.device("meta"), allow_pickle=allow_pickle,
                         trust_remote_code=trust_remote_code, load_dense=False)
    layout = loaded.layout
    if expert_format is not None:
        params, slot_bytes, _ = quantized_params(layout.params, expert_format)
        layout = replace(layout, params=params, slot_bytes=slot_bytes, expert_format=expert_format)
    return describe(loaded.files, layout, loaded.model.config, loaded.dtype, "-", "-", loaded.text_only)
