"""A GGUF file's memory needs, in the file's own bytes, for the fit verdict.

Read from the file's headers with the loader's own layout (engine.model.gguf_layout), so the expert
slot, the `all` budget and the minimum are what the engine will use: the experts in their quant type
(a tensor converted at load in its new one), the dense weights as the file stores them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine.formats.blocks import format_name
from engine.hub.estimate import SizeEstimate, estimate_from_config


def estimate_gguf(path: Path) -> SizeEstimate:
    import torch

    from engine.model.loader import build_model

    loaded = build_model(path, device=torch.device("meta"), load_dense=False)
    layout, gguf_model = loaded.layout, loaded.gguf
    assert gguf_model is not None
    file_bytes = sum(part.stat().st_size for part in gguf_model.parts)
    est = estimate_from_config(loaded.files.config, weight_file_bytes=file_bytes)
    return replace(
        est, dense_bytes=layout.dense_bytes, expert_bytes=layout.all_expert_bytes, bytes_per_expert=layout.slot_bytes,
        all_expert_bytes=layout.all_expert_bytes, min_budget_bytes=layout.min_budget_bytes,
        expert_format=format_name(layout.expert_format), quantization="gguf",
        expert_param_shapes=[],  # a GGUF's experts stay in the file's types: no other format to offer
        notes=[*est.notes, f"GGUF, experts in {format_name(layout.expert_format)}; opened in place, never copied"])
