"""A quantized checkpoint's own tensors laid into MoEScope's row blocks, byte for byte, no rounding.

- MXFP4 as gpt-oss ships it: `*_blocks` [rows, blocks, 16] (element 2i in the low nibble of byte i,
  2i+1 in the high one) and `*_scales` [rows, blocks] (e8m0 exponents) become GGUF's block_mxfp4
  (the exponent, then elements 0-15 in the low nibbles and 16-31 in the high ones). The codes and
  exponents are the same numbers: transformers' 2^(e-127) * e2m1 equals gguf's 2^(e-128) * 2 e2m1.
- Block-wise FP8: e4m3 `weight` [rows, cols] and `weight_scale_inv` [row tiles, column tiles]
  (float32, one per tile) become rows of 128-column blocks, each led by its tile's scale.

The store calls these on every expert it reads, so a checkpoint is never copied or rewritten.
"""

from __future__ import annotations

import torch

from engine.formats.blocks import FP8, MXFP4

# blocks a chunk of the relay works on: small enough that its temporaries are a few hundred KiB
RELAY_CHUNK_BLOCKS = 4096


def mxfp4_from_openai(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 `blocks` [rows * n, 16] and `scales` [rows * n] into `out` [rows * n, 17] (uint8).

    `blocks` may be the last 16/17 of `out`'s own bytes (the store reads a checkpoint's blocks there):
    each chunk is copied out before its output is written, and output never reaches a later chunk's
    input. Chunks bound the temporaries, whatever the matrix's size."""
    out = out.view(-1, MXFP4.block_bytes)
    scales = scales.reshape(-1)
    for start in range(0, blocks.shape[0], RELAY_CHUNK_BLOCKS):
        stop = min(start + RELAY_CHUNK_BLOCKS, blocks.shape[0])
        chunk = blocks[start:stop].clone()
        codes = torch.stack([chunk & 0x0F, chunk >> 4], dim=-1).reshape(-1, 32)  # element order
        out[start:stop, 0] = scales[start:stop]
        torch.bitwise_or(codes[:, :16], codes[:, 16:] << 4, out=out[start:stop, 1:])


def openai_from_mxfp4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse: GGUF MXFP4 blocks [n, 17] as gpt-oss's (blocks [n, 16], scales [n])."""
    packed = packed.reshape(-1, MXFP4.block_bytes)
    qs = packed[:, 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(-1, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), packed[:, 0].clone()


def fp8_from_tiles(weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3 bytes `weight` [rows, cols] (uint8) and float32 `scale_inv` [row tiles, col tiles] into
    `out` [rows, cols / 128 * 132] (uint8); tiles are 128 columns wide and rows / row tiles high.

    As above, `weight` may be the last 128/132 of `out`'s own bytes, and the work goes in bounded chunks."""
    rows, cols = weight.shape
    blocks = cols // FP8.block
    tile_rows = -(-rows // scale_inv.shape[0])
    scale_bytes = scale_inv.float().contiguous().view(torch.uint8).view(-1, blocks, 4)
    view = out.view(rows, blocks, FP8.block_bytes)
    step = max(1, RELAY_CHUNK_BLOCKS // blocks)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        chunk = weight[start:stop].clone()
        view[start:stop, :, :4] = scale_bytes[torch.arange(start, stop) // tile_rows]
        view[start:stop, :, 4:] = chunk.view(-1, blocks, FP8.block)
