"""MoEScope's weight formats in the benchmarks, each set against the llama.cpp type of the same bits.

`load_settings` is the one place a format name becomes MoEScope load settings: a quantized
format plugs in here (and in `bytes_per_token`) when the engine has it.
"""

from __future__ import annotations

from pathlib import Path

LLAMA_TYPE = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k": "Q4_K_M"}


class FormatNotAvailable(ValueError):
    """MoEScope cannot run this format (yet); the message is one line for the table."""


def _check(fmt: str) -> None:
    if fmt not in LLAMA_TYPE:
        raise FormatNotAvailable(f"unknown format {fmt!r} (known: {', '.join(LLAMA_TYPE)})")


def load_settings(fmt: str) -> dict:
    """The `LoadModel` fields that make MoEScope run `fmt`: bf16 compute, experts in the format."""
    _check(fmt)
    return {"dtype": "bfloat16"} | ({} if fmt == "bf16" else {"expert_format": fmt})


def bytes_per_token(model_dir: Path, fmt: str) -> int:
    """Bytes of weights one decode token reads in `fmt` (the memory-bandwidth limit's numerator)."""
    from bench.decode_limit import active_bytes_per_token

    _check(fmt)
    return active_bytes_per_token(model_dir, None if fmt == "bf16" else fmt)[0]
