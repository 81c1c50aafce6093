"""Decode-step matrix-vector products through torch's native CPU kernel instead of oneDNN.

On CPU, torch sends bf16/fp16 matmuls to oneDNN. For one-row products (a decode step) oneDNN
streams weights at about half the memory bandwidth; torch's own kernel, chosen when oneDNN is
disabled, streams at about 85 % of it (bench/profile_decode.py: 23 vs 37 GB/s on 2 cores). Both
accumulate in float32, but in a different order, so results are not bit-identical to transformers'
default kernel: this is opt-in (`--fast-gemv`), and prefill (many rows, where oneDNN's GEMM is
15x faster) always keeps oneDNN. float32 matmuls use MKL either way and are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def native_gemv(enabled: bool) -> Iterator[None]:
    """Within the block, CPU bf16/fp16 matmuls skip oneDNN (process-wide; restored on exit)."""
    if not enabled:
        yield
        return
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous
