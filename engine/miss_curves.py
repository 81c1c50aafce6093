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
        # stacks[layer]: experts, most recently used first; it starts in the warm-up order.
        self.stacks: list[list[int]] = []
        for layer in range(num_layers):
            order = list(warm_order[layer]) if warm_order else list(range(num_experts))
            seen = set(order)
            self.stacks.append(order + [e for e in range(num_experts) if e not in seen])
        # Plain lists on the hot path (a few list operations per token beat a dozen numpy calls).
        self._hist: list[list[int]] = [[0] * num_experts for _ in range(num_layers)]
        self._tokens: list[int] = [0] * num_layers
        self.steps = 0

    def record(self, layer: int, experts: Iterable[int], tokens: int = 1) -> None:
        """Layer `layer` needed `experts` (unique) for one forward step over `tokens` tokens."""
        ids = sorted(experts)
        stack, hist = self.stacks[layer], self._hist[layer]
        for e in ids:  # positions on the stack before this step
            hist[stack.index(e)] += 1
        for e in reversed(ids):  # then to the top, the smallest id most recent
            stack.remove(e)
            stack.insert(0, e)
        self._tokens[layer] += tokens
        if layer == 0:
            self.steps += 1

    @property
    def hist(self) -> np.ndarray:
        """[layers, stack position] accesses found at each position."""
        return np.asarray(self._hist, dtype=np.int64)

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self._tokens, dtype=np.int64)

    def has_data(self) -> bool:
        return any(self._tokens)

    def curves(self) -> np.ndarray:
        """[layers, experts + 1] float32: expected misses per token of each layer with s slots."""
        return curves_from_histogram(self.hist, self.tokens)


def curves_from_histogram(hist: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    num_layers, num_experts = hist.shape
    tail = np.zeros((num_layers, num_experts + 1), dtype=np.float64)
    tail[:, :num_experts] = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # misses(s) = accesses at positions >= s
    per_token = tail / np.maximum(tokens, 1)[:, None]
    return per_token.astype(np.float32)
