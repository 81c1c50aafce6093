"""Per-layer least-recently-used eviction (Mixtral-offloading, Eliseev & Mazur 2023)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.base import CachePolicy
from engine.accounting.routing import RoutingStep


class LRUPolicy(CachePolicy):
    name = "lru"
    description = "least recently used expert per layer is evicted (Mixtral-offloading)"

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self._clock = 0
        # last_use[layer, expert]: a global counter value; 0 = never used.
        self._last_use = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._accessed_at = np.full(num_layers, -1, dtype=np.int64)  # clock of each layer's latest access
        self._last_at = np.full(num_layers, -1, dtype=np.int64)  # and of its last token, in a many-token step

    def on_access(self, step: RoutingStep) -> None:
        clocks = self._clock + np.arange(1, len(step.layers) + 1)  # one tick per layer, in layer order
        self._last_use[step.layers[:, None], step.experts] = clocks[:, None]
        self._accessed_at[step.layers] = clocks
        self._clock += len(step.layers)
        if step.last is not None:  # a prompt's last token used its experts after the others: one tick later
            self._clock += 1
            self._last_use[step.layers[:, None], step.last] = self._clock
        # only this access's ticks mean "asked for now" to on_insert, not an older prompt's last one
        self._last_at[step.layers] = self._clock if step.last is not None else -1

    def on_insert(self, layer: int, expert: int) -> None:
        super().on_insert(layer, expert)
        # An expert loaded without being asked for right now (warm-up, prefetch) counts as just used,
        # or the next miss would evict it before it is ever needed.
        if self._last_use[layer][expert] not in (self._accessed_at[layer], self._last_at[layer]):
            self._clock += 1
            self._last_use[layer][expert] = self._clock

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        candidates = list(candidates)
        return candidates[int(np.argmin(self._last_use[layer, candidates]))]  # the first of equals, as min()
