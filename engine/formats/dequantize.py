"""Block formats back to float, in torch: the reference every quantized kernel is held to.

Each format computes what the `gguf` package's numpy dequantizer computes, operation for
operation in float32 (a scale times a level, minus a min: two roundings, no fused multiply-add),
so the values are bit-identical to it (tests/test_formats.py). A model "with its experts
dequantized" — what MoEScope's exact kernels and its quantized kernels are compared against — is
the model whose weights are these values rounded once to the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.formats.blocks import QK_K, BlockFormat


def dequantize(packed: torch.Tensor, fmt: BlockFormat, columns: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 `packed` [rows, row_bytes] (or any shape with that many bytes) as [rows, columns] in
    `dtype`, through float32; into `out` when given."""
    blocks = packed.reshape(-1, fmt.block_bytes)
    values = _DECODERS[fmt.name](blocks).reshape(-1, columns)
    if out is None:
        return values.to(dtype)
    out.copy_(values.view_as(out))
    return out


# (packed blocks, format, columns, out): fills `out` with the reference's dequantized values. This
# module's torch code is the default; a faster one giving the same values may replace it where
# weights are expanded for torch's kernels (engine.decode.native.kernels.slot_dequantizer).
Dequantizer = Callable[[torch.Tensor, BlockFormat, int, torch.Tensor], None]


def reference_dequantizer(packed: torch.Tensor, fmt: BlockFormat, columns: int, out: torch.Tensor) -> None:
    dequantize(packed, fmt, columns, out=out)


@functools.cache
def _constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device,
              shape: tuple[int, ...]) -> torch.Tensor:
    """A small table (bit shifts, code values) on the blocks' device, made once per device: a GPU's
    slots are dequantized where they are, one expert at a time. Read only."""
    return torch.tensor(values, dtype=dtype, device=device).reshape(shape)


def _shifts(values: tuple[int, ...], like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return _constant(values, torch.uint8, like.device, shape)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes as [n, 32] values 0..15: low nibbles first, then high ones (Q4_0, Q5_0)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    return (_nibbles(blocks[:, 2:18]).to(torch.int8) - 8).float() * d


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    qh = blocks[:, 2:6].contiguous().view(torch.int32).long() & 0xFFFFFFFF  # 32 high bits, little-endian
    high = ((qh >> _constant(tuple(range(32)), torch.int64, qh.device, (1, 32))) & 1).to(torch.uint8)
    q = (_nibbles(blocks[:, 6:22]) | (high << 4)).to(torch.int8) - 16
    return d * q.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales = blocks[:, 4:16].long().reshape(n, 3, 4)
    low, high, mixed = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=1).float()
    m = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=1).float()
    step = (d * sc).reshape(n, 8, 1)
    offset = (dmin * m).reshape(n, 8, 1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.stack([qs[:, :, 0] & 0x0F, qs[:, :, 0] >> 4], dim=2).reshape(n, 8, 32).float()
    return (step * q - offset).reshape(n, QK_K)


def _levels_2bit(qs: torch.Tensor) -> torch.Tensor:
    """[n, 64] bytes as [n, 256] levels 0..3 (GGUF's order: within each 128, 4 shifts of 32 bytes)."""
    n = qs.shape[0]
    shifts = _shifts((0, 2, 4, 6), qs, (1, 1, 4, 1))
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    step = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    offset = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _levels_2bit(blocks[:, 16:80]).reshape(n, 16, 16).float()
    return (step * q - offset).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _half(blocks, 108)
    low = (scales[:, 0:8].reshape(n, 1, 8) >> _shifts((0, 4), blocks, (1, 2, 1))).reshape(n, 16)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> _shifts((0, 2, 4, 6), blocks, (1, 4, 1))).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    step = (d * sc.float()).reshape(n, 16, 1)
    bits = _shifts(tuple(range(8)), blocks, (1, 8, 1))
    h = ((hmask.reshape(n, 1, 32) >> bits) & 1).reshape(n, QK_K) ^ 1  # a set bit means no offset
    q = (_levels_2bit(qs).to(torch.int8) - (h << 2).to(torch.int8)).reshape(n, 16, 16).float()
    return (step * q).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208]
    d = _half(blocks, 208)
    step = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    # Within each half of 128: elements 32j..32j+31 are ql bytes 0..31 (j = 0, 2) or 32..63 (j = 1, 3),
    # low nibbles for j < 2 and high ones for j >= 2; qh holds their top two bits at shift 2j.
    low = ((ql.reshape(n, 2, 1, 64) >> _shifts((0, 4), blocks, (1, 1, 2, 1))) & 0x0F)
    low = low.reshape(n, 2, 4, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), blocks, (1, 1, 4, 1))) & 0x03)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (step * q).reshape(n, QK_K)


# e2m1 codes as GGUF's MXFP4 tables them: twice the OCP values, so the scale is 2^(e - 128).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) as float32 (gguf's e8m0_to_fp32_half: exponents 0 and 1 are subnormal)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(blocks[:, 0:1])
    table = _constant(MXFP4_VALUES, torch.float32, blocks.device, (16,))
    return table[_nibbles(blocks[:, 1:17]).long()] * d


def _fp8(blocks: torch.Tensor) -> torch.Tensor:
    # transformers' Fp8Dequantize: the e4m3 value in float32 times the tile's float32 scale
    d = blocks[:, 0:4].contiguous().view(torch.float32)
    return blocks[:, 4:].contiguous().view(torch.float8_e4m3fn).float() * d


_DECODERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q5_0": _q5_0, "q4_k": _q4_k, "q2_k": _q2_k, "q3_k": _q3_k,
             "q6_k": _q6_k, "mxfp4": _mxfp4, "fp8": _fp8}
