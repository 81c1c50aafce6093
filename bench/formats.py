"""MoEScope's weight formats in the benchmarks, each set against the llama.cpp type of the same bits.

`load_settings` is the one place a format name becomes MoEScope load settings. A name is
`<experts>` (dense weights in the same format, as llama.cpp's single-type GGUFs have them; `bf16`:
nothing quantized) or `<experts>-d<dense>` for mixed quantization, e.g. `q4_k-dq8_0` (4-bit
experts, 8-bit dense weights). llama.cpp's Q4_K_M keeps a few dense tensors at Q6_K, so `q4_k`
(all dense Q4_K) reads slightly fewer bytes a token than it, and `q4_k-dq6_k` slightly more.
`mxfp4` is llama.cpp's MXFP4_MOE (gpt-oss's format): MXFP4 experts, dense weights Q8_0 (its
default type for the other tensors), so its dense format is q8_0 unless named.
"""

from __future__ import annotations

from pathlib import Path

LLAMA_TYPE = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k": "Q4_K_M", "q4_k-dq6_k": "Q4_K_M", "q4_k-dq8_0": "Q4_K_M",
              "mxfp4": "MXFP4_MOE"}
DENSE_OF = {"mxfp4": "q8_0"}  # experts-only llama.cpp types: the dense type they keep


class FormatNotAvailable(ValueError):
    """MoEScope cannot run this format (yet); the message is one line for the table."""


def _check(fmt: str) -> None:
    if fmt not in LLAMA_TYPE:
        raise FormatNotAvailable(f"unknown format {fmt!r} (known: {', '.join(LLAMA_TYPE)})")


def split_format(fmt: str) -> tuple[str | None, str | None]:
    """(expert format, dense format) of a bench format name; None: the checkpoint's own weights."""
    experts, _, dense = fmt.partition("-d")
    if experts == "bf16":
        return None, None
    return experts, dense or DENSE_OF.get(experts, experts)


def load_settings(fmt: str) -> dict:
    """The `LoadModel` fields that make MoEScope run `fmt`: bf16 compute, weights in the format."""
    _check(fmt)
    experts, dense = split_format(fmt)
    return {"dtype": "bfloat16"} | ({} if experts is None else {"expert_format": experts, "dense_format": dense})


def bytes_per_token(model_dir: Path, fmt: str) -> int:
    """Bytes of weights one decode token reads in `fmt` (the memory-bandwidth limit's numerator)."""
    from bench.decode_limit import active_bytes_per_token

    _check(fmt)
    experts, dense = split_format(fmt)
    return active_bytes_per_token(model_dir, experts, dense)[0]
