"""Belady's MIN: evict the expert whose next use is farthest away. Offline (it reads the future),
so it only runs in trace replay, as the lower bound on loads for a given number of slots.

With set accesses (a step needs all its experts at once) MIN is applied among the experts the
step does not need, which keeps it optimal for demand loading.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from engine.accounting.policies.base import CachePolicy


class BeladyPolicy(CachePolicy):
    name = "belady"
    description = "offline optimal eviction (farthest next use); trace replay only"

    def __init__(self, future: Sequence[Sequence[Sequence[int]]]) -> None:
        """`future[layer]`: the expert sets that layer will need, in order."""
        self.future = future

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self._pos = [-1] * num_layers  # index of the current access in future[layer]
        self._uses: list[dict[int, list[int]]] = []
        for sets in self.future:
            uses: dict[int, list[int]] = {}
            for i, experts in enumerate(sets):
                for e in experts:
                    uses.setdefault(e, []).append(i)
            self._uses.append(uses)

    def on_layer_access(self, layer: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        self._pos[layer] += 1

    def next_use(self, layer: int, expert: int) -> float:
        uses = self._uses[layer].get(expert, ())
        i = bisect_right(uses, self._pos[layer])
        return uses[i] if i < len(uses) else float("inf")

    def needed_next(self, layer: int, expert: int) -> bool:
        """Does `layer`'s next step need `expert`?"""
        return self.next_use(layer, expert) == self._pos[layer] + 1

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        return max(candidates, key=lambda e: (self.next_use(layer, e), e))

    def preferred(self, layer: int) -> list[int]:
        # the best warm-up: the experts needed soonest
        uses = self._uses[layer]
        return sorted(uses, key=lambda e: uses[e][0])
