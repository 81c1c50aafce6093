"""Opt-in CPU decode kernels (`--fast-decode`): the same arithmetic as transformers, summed in a
different order, so faster but not bit-identical to its default kernels.

Two changes, both for decode steps only (one new token; prefill keeps transformers' kernels):
- matrix-vector products in bf16/fp16 skip oneDNN for torch's native kernel. oneDNN streams
  expert-sized weights at about half the memory bandwidth; torch's own kernel at about 85 % of it
  (bench/profile_decode.py: 23 vs 37 GB/s on 2 cores). For many rows oneDNN's GEMM is 15x faster,
  which is why prefill keeps it.
- single-query attention runs as two float32 matmuls and a softmax instead of SDPA's flash
  kernel, which costs ~120 us per layer on 2 cores for one query (the matmuls ~30 us); float32
  accumulation, as the flash kernel does, with the softmax in float32.
float32 models keep their kernels (MKL either way; the attention swap applies to bf16/fp16 only),
so their outputs stay identical to transformers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

ATTENTION_NAME = "moescope_sdpa"
_active = False  # inside a fast decode step (one generation at a time per engine process)


@contextmanager
def fast_decode_step(enabled: bool) -> Iterator[None]:
    """Within the block, CPU matmuls skip oneDNN and one-query attention takes the matmul path."""
    global _active
    if not enabled:
        yield
        return
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    _active = True
    try:
        yield
    finally:
        _active = False
        torch.backends.mkldnn.enabled = previous


def _one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float | None) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query, key/value heads shared by groups of query heads."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()  # each group of heads meets its kv head
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())
    return out.to(query.dtype).reshape(batch, heads, 1, dim).transpose(1, 2)  # [batch, 1, heads, dim], as SDPA's wrapper


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one-query steps of a fast decode (no mask, no extras)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (_active and query.shape[2] == 1 and attention_mask is None and query.device.type == "cpu"
             and query.dtype != torch.float32 and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
             and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _one_query_attention(query, key, value, scaling), None


def install(model: torch.nn.Module) -> bool:
    """Route `model`'s attention through `attention` if it uses SDPA; True if it does now."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation != "sdpa":
        return False
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # same masks as SDPA
    model.set_attn_implementation(ATTENTION_NAME)
    return model.config._attn_implementation == ATTENTION_NAME
