"""Attention of one query inside a native step, for models whose attention modules call transformers'
attention interface (SDPA, or the family's own eager function): two float32 matmuls and a softmax.

For one query the fixed costs dominate: SDPA's flash kernel sets up per call, and an eager
function repeats key/value heads, matmuls in bf16 with a new shape every token and concatenates
(GPT-OSS's attention sinks). Here grouped query heads meet their key/value head directly, an
additive mask (eager masks, sliding windows) is added to the scores, and attention sinks (GPT-OSS's
`s_aux`) join the softmax's denominator only, as they do in transformers. Outside a native step,
or for anything else (several queries, dropout, other extras), the model's own function runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from engine.decode.modules.switch import switched_on

SDPA_NAME = "moescope_sdpa"
EAGER_NAME = "moescope_eager"


def is_eager(config) -> bool:
    """The model attends with transformers' eager function (or our one-query version of it), whose
    bf16 ops round where the native kernels must round too."""
    return config._attn_implementation in ("eager", EAGER_NAME)


def one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              eager_rounding: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one query, key/value heads shared by groups of query heads;
    `sinks` (one logit per query head) take part in the softmax's normalisation only. Sums in float32;
    `eager_rounding` rounds to the query's dtype where an eager function's bf16 ops round (the
    scores, their scaling, the mask, the shift by the maximum, the probabilities, the output), so
    near-ties fall as they fall in the model's own code; SDPA's kernel keeps float32 throughout."""
    batch, heads, _, dim = query.shape
    kv_heads, positions, value_dim = key.shape[1], key.shape[2], value.shape[-1]  # MLA values can be narrower
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(query.dtype).float() if eager_rounding else t

    q = query.reshape(batch, kv_heads, groups, dim).float()  # each group of heads meets its kv head
    scores = rounded(rounded(torch.matmul(q, key.float().transpose(-1, -2))) * scale)  # [b, kv_heads, groups, pos]
    if mask is not None:
        mask = mask[..., :positions]  # as transformers slices it for SDPA
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        scores = rounded(scores + mask.float().reshape(batch, -1 if mask.shape[1] == 1 else kv_heads,
                                                       1 if mask.shape[1] == 1 else groups, positions))
    if sinks is None:
        weights = rounded(torch.softmax(scores, dim=-1))
    else:
        sink = sinks.float().reshape(1, kv_heads, groups, 1)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        scores, sink = rounded(scores - top), rounded(sink - top)
        exp = torch.exp(scores)
        weights = rounded(exp / (exp.sum(dim=-1, keepdim=True) + torch.exp(sink)))
    out = torch.matmul(weights, value.float())
    return out.to(query.dtype).reshape(batch, heads, 1, value_dim).transpose(1, 2)  # [batch, 1, heads, dim], as SDPA's


# Keywords the one-query path may see set and still compute what the model's own function computes
# (a sliding window arrives as the mask; sinks are handled). Anything else set (a soft-cap, a
# position bias, attention weights asked for...) falls back to the model's own function.
UNDERSTOOD_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits", "is_causal",
                               "return_dict", "sliding_window", "s_aux"})


def _one_query_applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float,
                       kwargs: dict) -> bool:
    unknown = any(value is not None and value is not False for name, value in kwargs.items()
                  if name not in UNDERSTOOD_KWARGS)
    return (switched_on(module) and not unknown and query.shape[2] == 1 and dropout == 0.0
            and query.device.type == "cpu" and query.dtype != torch.float32
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0)


def sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one-query steps inside a native step without a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (not _one_query_applies(module, query, key, dropout, kwargs) or attention_mask is not None
            or kwargs.get("s_aux") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return one_query(query, key, value, scaling), None


def _own_eager(module: torch.nn.Module) -> Callable | None:
    """The eager attention function of the module's family (its modeling file's)."""
    cls = getattr(type(module), "_moescope_plain", type(module))
    return getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)


def eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's eager attention, except one-query steps inside a native step (sinks and masks included)."""
    sinks = kwargs.get("s_aux")
    if not _one_query_applies(module, query, key, dropout, kwargs) or (
            sinks is not None and sinks.numel() != query.shape[1]):
        return _own_eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)
    return one_query(query, key, value, scaling, attention_mask, sinks, eager_rounding=True), None


def install(model: torch.nn.Module) -> None:
    """Route `model`'s attention through the one-query versions: SDPA models always; eager ones when
    every attention module's family has its own eager function to fall back on."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        ALL_ATTENTION_FUNCTIONS.register(SDPA_NAME, sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_NAME, sdpa_mask)  # same masks as SDPA
        model.set_attn_implementation(SDPA_NAME)
    elif implementation == "eager":
        attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        if not attentions or any(_own_eager(m) is None for m in attentions):
            return
        ALL_ATTENTION_FUNCTIONS.register(EAGER_NAME, eager_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER_NAME, eager_mask)  # same masks as eager
        model.set_attn_implementation(EAGER_NAME)
