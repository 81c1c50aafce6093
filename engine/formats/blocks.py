"""The block formats an expert's (or a dense) weight matrix can be stored in, and their sizes.

MoEScope uses GGUF's block layouts as they are (llama.cpp's `block_q8_0`, `block_q4_K`, ...), so
a GGUF file's quantized tensors and MoEScope's own quantized store hold the same bytes, and the
`gguf` package's reference dequantizer checks ours. A matrix is quantized row by row along its
input (contraction) dimension, which must be a whole number of blocks.

Numpy only: the window imports this to label formats and count bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # elements of a K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str  # what the user types: q8_0, q4_k, ...
    ggml_type: int  # gguf.GGMLQuantizationType of the same bytes
    block: int  # elements per block
    block_bytes: int  # bytes per block
    label: str  # for the user

    @property
    def bits(self) -> float:
        """Stored bits per weight, scales included."""
        return self.block_bytes * 8 / self.block

    def row_bytes(self, columns: int) -> int:
        return columns // self.block * self.block_bytes

    def packed_bytes(self, shape: tuple[int, ...]) -> int:
        rows = 1
        for dim in shape[:-1]:
            rows *= dim
        return rows * self.row_bytes(shape[-1])

    def fits(self, columns: int) -> bool:
        return columns % self.block == 0


# GGMLQuantizationType values (gguf.constants): Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q6_K = 14,
# MXFP4 = 39.
# MXFP4 (OCP microscaling, gpt-oss's experts): GGUF's block_mxfp4, one e8m0 exponent byte then 16
# bytes of e2m1 codes, elements 0-15 in the low nibbles and 16-31 in the high ones. gpt-oss
# checkpoints hold the same codes and exponents in two tensors (and pair the nibbles differently);
# engine.formats.relay lays them into these blocks.
MXFP4 = BlockFormat("mxfp4", 39, 32, 17, "4-bit (MXFP4)")
# Block-wise FP8 (DeepSeek-V3, Qwen3 FP8 checkpoints: e4m3 weights, one float32 scale per tile of
# 128x128): MoEScope's own row blocks, the tile's float32 scale then 128 e4m3 bytes, so each row is
# whole blocks like the GGUF layouts. No GGML type has it; 200 is this engine's id for it.
FP8 = BlockFormat("fp8", 200, 128, 132, "8-bit (FP8 e4m3, block scales)")
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q8_0", 8, 32, 34, "8-bit (Q8_0)"),
    BlockFormat("q6_k", 14, QK_K, 210, "6-bit (Q6_K)"),
    BlockFormat("q5_0", 6, 32, 22, "5-bit (Q5_0)"),
    BlockFormat("q4_k", 12, QK_K, 144, "4-bit (Q4_K)"),
    BlockFormat("q4_0", 2, 32, 18, "4-bit (Q4_0)"),
    MXFP4,
    BlockFormat("q3_k", 11, QK_K, 110, "3-bit (Q3_K)"),
    BlockFormat("q2_k", 10, QK_K, 84, "2-bit (Q2_K)"),
)}
# The K-quants: 256-element super-blocks whose sub-block scales weight integer products (the formats
# whose inputs --int8-inputs rounds to 8 bits; src/formats/types.h, has_two_plane_dot).
K_QUANTS = tuple(name for name, f in FORMATS.items() if f.block == QK_K)
ALIASES = {"8bit": "q8_0", "6bit": "q6_k", "4bit": "q4_k", "3bit": "q3_k", "2bit": "q2_k"}
# A matrix whose input features are not whole 256-element super-blocks takes the 32-element format
# llama.cpp's quantizer falls back to for it (llama-quant.cpp, tensor_type_fallback).
FALLBACK = {"q6_k": "q8_0", "q4_k": "q5_0", "q3_k": "q4_0", "q2_k": "q4_0"}
ORIGINAL = ("original", "bf16", "fp16", "fp32", "auto", "")  # the checkpoint's own dtype: no quantization


def parse_format(name: str | None) -> BlockFormat | None:
    """The block format a user's word names; None for the checkpoint's own dtype."""
    key = (name or "").strip().lower()
    if key in ORIGINAL:
        return None
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        choices = ", ".join(["original", *ALIASES, *FORMATS])
        raise ValueError(f"unknown weight format '{name}'; choose one of: {choices}")
    return FORMATS[key]


def checkpoint_format(name: str) -> BlockFormat:
    """A block format by name, including the checkpoint-only ones (FP8), for manifests and kernels."""
    return FP8 if name == FP8.name else FORMATS[name]


def format_name(fmt: BlockFormat | None) -> str:
    return fmt.name if fmt is not None else "original"


def formats_that_fit(columns: int) -> list[str]:
    return [name for name, fmt in FORMATS.items() if fmt.fits(columns)]


def format_for(fmt: BlockFormat, columns: int) -> BlockFormat | None:
    """`fmt`, or the format llama.cpp falls back to when `columns` are not whole blocks of it; None
    when neither fits."""
    if fmt.fits(columns):
        return fmt
    fallback = FORMATS.get(FALLBACK.get(fmt.name, ""))
    return fallback if fallback is not None and fallback.fits(columns) else None
