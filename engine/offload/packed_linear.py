"""Expert matrices pre-arranged ("packed") for oneDNN on CPU: the same bits as transformers, faster.

transformers' default CPU path for a bf16 `F.linear` is oneDNN, which re-arranges the weight into
its blocked layout on every call; for one-row products (a decode step) that costs most of the time.
Arranging each expert matrix once, when it is loaded into the cache, and calling the same oneDNN
primitive on it (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's freezing pass uses)
streams several times faster (docs/performance.md) and gives bit-identical results, for one
row and for many: the kernel and its arithmetic are the same, only the re-arrangement moved.

A packed matrix is an opaque oneDNN tensor, so the cache keeps it per slot beside its byte pool
(engine.offload.expert_cache). `available()` checks this machine (ops present, results bit-identical on a few
shapes) before anything is packed; otherwise everything stays as transformers has it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.bfloat16, torch.float16)
PACKABLE = ("gate_up_proj", "up_proj", "down_proj")  # [out, in] expert matrices (not biases)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Packing is possible here and gives exactly `F.linear`'s bits (checked once per dtype)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        for rows, out, inner in ((1, 96, 64), (7, 64, 96), (33, 48, 80)):
            weight = torch.randn(out, inner, generator=generator).to(dtype)
            x = torch.randn(rows, inner, generator=generator).to(dtype)
            if not torch.equal(linear(x, pack(weight)), F.linear(x, weight)):
                return False
    except (RuntimeError, AttributeError):  # an older or mkldnn-less build
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) re-arranged for oneDNN: a new, opaque tensor of the same size."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a packed weight (same bits)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
