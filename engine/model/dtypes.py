"""Dtypes: safetensors tags, the compute dtypes the engine runs, and their names for the user."""

from __future__ import annotations

import torch

from engine.errors import CheckpointError

# safetensors dtype tag -> element size in bytes (the format's own list; checkpoint headers are checked with it)
TAG_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}

_TORCH_OF_TAG = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(tag: str) -> torch.dtype:
    """The torch dtype of a safetensors tag the engine can read."""
    if tag not in _TORCH_OF_TAG:
        raise CheckpointError(f"tensors of dtype {tag} (quantized checkpoints) are not supported yet")
    return _TORCH_OF_TAG[tag]


def resolve_dtype(name: str, config: dict) -> torch.dtype:
    """The compute dtype: `name` if given, else the one config.json declares (float32 if none)."""
    if name != "auto":
        if name not in COMPUTE_DTYPES:
            raise CheckpointError(f"unknown dtype '{name}'; use auto, float32, bfloat16 or float16")
        return COMPUTE_DTYPES[name]
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return COMPUTE_DTYPES.get(str(declared).removeprefix("torch."), torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
