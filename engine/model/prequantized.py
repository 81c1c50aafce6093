"""Checkpoints that ship quantized weights: which tensors are data, which are their scales, and the
block format the experts keep in the store, the slots and the kernels.

- `mxfp4` (gpt-oss): `<name>_blocks` (uint8 e2m1 codes) + `<name>_scales` (e8m0 exponents) stand
  for the weight `<name>`; experts stay MXFP4.
- `fp8` with `weight_block_size` (DeepSeek-V3, Qwen3 FP8): an e4m3 `<name>.weight` + its float32
  `<name>.weight_scale_inv` per 128x128 tile; experts stay FP8, dense weights are dequantized at load.

Any other `quant_method` is refused in one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import CheckpointError
from engine.formats.blocks import FP8, MXFP4, BlockFormat
from engine.formats.dequantize import dequantize
from engine.formats.relay import mxfp4_from_openai
from engine.model.checkpoint import TensorRecord

SUPPORTED = ("mxfp4", "fp8")


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "mxfp4" or "fp8"
    fmt: BlockFormat  # the blocks its experts are kept in

    def is_scale(self, key: str) -> bool:
        return key.endswith("_scales") if self.method == "mxfp4" else key.endswith(".weight_scale_inv")

    def scale_of(self, key: str, record: TensorRecord) -> str | None:
        """The name of the scale tensor `key` needs, or None when `key` is a plain tensor."""
        if self.method == "mxfp4":
            return key.removesuffix("_blocks") + "_scales" if key.endswith("_blocks") else None
        return key + "_scale_inv" if record.dtype.startswith("F8_") else None

    def weight_key(self, key: str) -> str:
        """The name of the weight a data tensor stands for (gpt-oss: `gate_up_proj_blocks` -> `gate_up_proj`)."""
        return key.removesuffix("_blocks") if self.method == "mxfp4" else key

    def matrix_shape(self, record: TensorRecord) -> tuple[int, ...]:
        """The weight's logical shape ([..., rows, columns]) from its data tensor's."""
        if self.method == "mxfp4":  # [..., rows, blocks, 16 bytes]
            *lead, blocks, _ = record.shape
            return (*lead, blocks * MXFP4.block)
        return record.shape


def checkpoint_quantization(config: dict) -> CheckpointQuantization | None:
    """How the checkpoint's config says its weights are quantized; None for plain weights."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method") or "") if isinstance(quant, dict) else ""
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4", MXFP4)
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not block or len(block) != 2 or int(block[1]) != FP8.block:
            raise CheckpointError(
                f"FP8 checkpoints with weight_block_size {block} are not supported; MoEScope reads block-wise "
                f"FP8 with {FP8.block}-column tiles (e.g. [128, 128], as DeepSeek-V3 and Qwen3 ship)")
        return CheckpointQuantization("fp8", FP8)
    raise CheckpointError(
        f"'{method or quant}' quantized checkpoints are not supported; MoEScope runs MXFP4 (gpt-oss) and "
        "block-wise FP8 checkpoints, or the original weights in any format it converts to")


def dequantize_tensor(quant: CheckpointQuantization, data: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """A dense weight read from the checkpoint, as the values transformers' dequantizer gives."""
    if quant.method == "mxfp4":
        *lead, blocks, _ = data.shape
        packed = torch.empty(data.numel() // 16, MXFP4.block_bytes, dtype=torch.uint8)
        mxfp4_from_openai(data.reshape(-1, 16), scale.reshape(-1), packed)
        return dequantize(packed, MXFP4, blocks * MXFP4.block, dtype).reshape(*lead, blocks * MXFP4.block)
    # transformers' Fp8Dequantize: e4m3 in float32 times its tile's float32 scale, then the dtype
    rows, cols = data.shape[-2:]
    tile_rows, tile_cols = -(-rows // scale.shape[-2]), -(-cols // scale.shape[-1])
    full = scale.float().repeat_interleave(tile_rows, dim=-2)[..., :rows, :].repeat_interleave(tile_cols, dim=-1)
    return (data.float() * full[..., :cols]).to(dtype)
