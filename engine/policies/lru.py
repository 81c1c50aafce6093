"""Per-layer least-recently-used eviction (Mixtral-offloading, Eliseev & Mazur 2023)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.policies.base import CachePolicy


class LRUPolicy(CachePolicy):
    name = "lru"
    description = "least recently used expert per layer is evicted (Mixtral-offloading)"

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self._clock = 0
        # last_use[layer][expert]: a global counter value; 0 = never used.
        self._last_use = [[0] * num_experts for _ in range(num_layers)]
        self._accessed_at = [-1] * num_layers  # clock of each layer's latest access

    def on_access(self, layer: int, experts: Sequence[int], counts: Sequence[int] | None = None) -> None:
        self._clock += 1
        self._accessed_at[layer] = self._clock
        row = self._last_use[layer]
        for e in experts:
            row[e] = self._clock

    def on_insert(self, layer: int, expert: int) -> None:
        super().on_insert(layer, expert)
        # An expert loaded without being asked for right now (warm-up, prefetch) counts as just used,
        # or the next miss would evict it before it is ever needed.
        if self._last_use[layer][expert] != self._accessed_at[layer]:
            self._clock += 1
            self._last_use[layer][expert] = self._clock

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        row = self._last_use[layer]
        return min(candidates, key=row.__getitem__)
