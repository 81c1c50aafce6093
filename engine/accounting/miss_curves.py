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

from collections.abc import Sequence

import numpy as np

from engine.accounting.routing import RoutingStep


class MissCurveRecorder:
    def __init__(self, num_layers: int, num_experts: int, warm_order: Sequence[Sequence[int]] | None = None) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        # The LRU stack as recency stamps: an expert's stack position is the number of experts of
        # its layer with a larger stamp. The same order as a list stack, but a step's positions
        # are one comparison, for one layer or for every layer of a token at once.
        self._stamp = np.zeros((num_layers, num_experts), dtype=np.int64)
        for layer in range(num_layers):
            order = list(warm_order[layer]) if warm_order else list(range(num_experts))
            seen = set(order)
            order += [e for e in range(num_experts) if e not in seen]
            self._stamp[layer, order] = np.arange(num_experts, 0, -1)  # position 0 most recent
        self._clock = num_experts + 1  # stamps handed out so far, for every layer alike
        self._hist = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._tokens = np.zeros(num_layers, dtype=np.int64)
        self.steps = 0

    def record(self, step: RoutingStep) -> None:
        """Each layer of `step` needed its row of (sorted, distinct) experts: one layer of a step,
        or every layer of a decode token at once (the same arithmetic either way)."""
        rows, ids = step.layers[:, None], step.experts
        current = self._stamp[rows, ids]
        positions = (self._stamp[step.layers][:, None, :] > current[:, :, None]).sum(axis=2)
        self._hist[rows, positions] += 1  # positions within a row are distinct: no double counts
        width = ids.shape[1]
        self._stamp[rows, ids] = self._clock + np.arange(width, 0, -1)  # the smallest id most recent
        self._clock += width
        self._tokens[step.layers] += step.tokens
        if step.layers[0] == 0:
            self.steps += 1

    @property
    def stacks(self) -> list[list[int]]:
        """Each layer's experts, most recently used first."""
        return [np.argsort(-row, kind="stable").tolist() for row in self._stamp]

    @property
    def hist(self) -> np.ndarray:
        """[layers, stack position] accesses found at each position."""
        return self._hist.copy()

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens.copy()

    def has_data(self) -> bool:
        return bool(self._tokens.any())

    def curves(self) -> np.ndarray:
        """[layers, experts + 1] float32: expected misses per token of each layer with s slots."""
        return curves_from_histogram(self.hist, self.tokens)


def curves_from_histogram(hist: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    num_layers, num_experts = hist.shape
    tail = np.zeros((num_layers, num_experts + 1), dtype=np.float64)
    tail[:, :num_experts] = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # misses(s) = accesses at positions >= s
    per_token = tail / np.maximum(tokens, 1)[:, None]
    return per_token.astype(np.float32)
