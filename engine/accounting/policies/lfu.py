"""Per-layer least-frequently-used eviction: the expert used in the fewest steps this session goes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.lru import LRUPolicy
from engine.accounting.routing import RoutingStep


class LFUPolicy(LRUPolicy):
    name = "lfu"
    description = "least frequently used expert per layer (since load) is evicted; ties by recency"

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self._uses = np.zeros((num_layers, num_experts), dtype=np.int64)

    def on_access(self, step: RoutingStep) -> None:
        super().on_access(step)
        self._uses[step.layers[:, None], step.experts] += 1  # one per step: a long prefill does not crown its experts

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        uses, last = self._uses[layer], self._last_use[layer]
        return min(candidates, key=lambda e: (uses[e], last[e]))
