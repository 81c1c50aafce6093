"""Per-layer least-frequently-used eviction: the expert used in the fewest steps this session goes."""

from __future__ import annotations

from collections.abc import Sequence

from engine.policies.lru import LRUPolicy


class LFUPolicy(LRUPolicy):
    name = "lfu"
    description = "least frequently used expert per layer (since load) is evicted; ties by recency"

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self._uses = [[0] * num_experts for _ in range(num_layers)]

    def on_access(self, layer: int, experts: Sequence[int], counts: Sequence[int] | None = None) -> None:
        super().on_access(layer, experts, counts)
        row = self._uses[layer]
        for e in experts:
            row[e] += 1  # one per forward step: a long prefill does not crown its experts forever

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        uses, last = self._uses[layer], self._last_use[layer]
        return min(candidates, key=lambda e: (uses[e], last[e]))
