"""Per-layer miss-ratio curves from recorded routing, via LRU stack distances (numpy only).

For each MoE layer we keep the LRU stack of its experts. When a forward step needs a set S of
experts, each e in S is found at stack position p(e) (how many experts were used more recently);
an LRU cache of s slots holds exactly the top s of the stack (the inclusion property, which holds
for set accesses too as long as |S| <= s), so e hits iff p(e) < s. One histogram of positions per
layer therefore gives the misses for every slot count at once:

    misses(layer, s) = sum over accesses with p >= s

The stack starts in the engine's warm-up order (expert 0 most recent), matching a cache that was
filled at load. Experts used in the same step are ordered by id (the smaller, the more recent).

Kept free of torch: the GUI imports the planner, which reads these curves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class MissCurveRecorder:
    def __init__(self, num_layers: int, num_experts: int, warm_order: Sequence[Sequence[int]] | None = None) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        # last[layer, expert]: step of the last use; warm-up order gives distinct negative stamps.
        self.last = np.empty((num_layers, num_experts), dtype=np.int64)
        for layer in range(num_layers):
            order = list(warm_order[layer]) if warm_order else list(range(num_experts))
            seen = set(order)
            order += [e for e in range(num_experts) if e not in seen]
            self.last[layer, order] = -1 - np.arange(num_experts)
        self.hist = np.zeros((num_layers, num_experts), dtype=np.int64)  # hist[layer, stack position]
        self.tokens = np.zeros(num_layers, dtype=np.int64)
        self.steps = 0
        self._clock = 0

    def record(self, layer: int, experts: Iterable[int], tokens: int = 1) -> None:
        """Layer `layer` needed `experts` (unique) for one forward step over `tokens` tokens."""
        ids = np.sort(np.fromiter(experts, dtype=np.int64))
        last = self.last[layer]
        if ids.size:
            position = (last[None, :] > last[ids][:, None]).sum(axis=1)  # experts used more recently
            self.hist[layer] += np.bincount(position, minlength=self.num_experts)
            # distinct stamps, the smaller id the more recent: no ties, so positions are a strict order
            self.last[layer, ids] = self._clock + np.arange(ids.size, 0, -1)
            self._clock += ids.size
        self.tokens[layer] += tokens
        if layer == 0:
            self.steps += 1

    def has_data(self) -> bool:
        return bool(self.tokens.any())

    def curves(self) -> np.ndarray:
        """[layers, experts + 1] float32: expected misses per token of each layer with s slots."""
        return curves_from_histogram(self.hist, self.tokens)


def curves_from_histogram(hist: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    num_layers, num_experts = hist.shape
    tail = np.zeros((num_layers, num_experts + 1), dtype=np.float64)
    tail[:, :num_experts] = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # misses(s) = accesses at positions >= s
    per_token = tail / np.maximum(tokens, 1)[:, None]
    return per_token.astype(np.float32)
