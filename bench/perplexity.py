"""Perplexity of a text through the engine (offloaded, with the current policy and budget).

For lossless policies it equals the model's perplexity; for lossy ones (swapmoe) the difference is
their quality cost. The text is scored in consecutive windows of at most the context length; each
window re-reads the last token of the previous one, so every token after the first is predicted
exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.errors import MoEScopeError


@torch.inference_mode()
def perplexity(runtime, token_ids: Sequence[int], *, window: int | None = None) -> float:
    """exp(mean negative log-likelihood) of `token_ids[1:]` given what precedes them."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise MoEScopeError("perplexity needs at least two tokens")
    window = max(2, min(window or runtime.context_length, runtime.context_length))
    runtime.counters.start_request()
    runtime.cache.policy.on_request_start()
    total, count = 0.0, 0
    start = 0
    while start < len(ids) - 1:
        chunk = torch.tensor([ids[start : start + window]], dtype=torch.long, device=runtime.device)
        logits = runtime.model(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False).logits
        runtime.counters.end_token()
        runtime.cache.policy.on_token_end()
        total += float(F.cross_entropy(logits[0, :-1].float(), chunk[0, 1:], reduction="sum"))
        count += chunk.shape[1] - 1
        start += window - 1
    return math.exp(total / count)
