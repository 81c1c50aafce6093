"""Fiddler's placement (Kamahori et al. 2024): the most popular experts stay put.

A calibration profile (routing counts recorded on calibration prompts, or built from a trace; see
`engine.accounting.profiles`) ranks each layer's experts. The most popular ones are pinned: all of a layer's
slots but top-k of them, so one token's experts always fit beside the pinned set. The remaining
slots rotate with LRU. Pinned experts that are not resident yet are fetched speculatively.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.lru import LRUPolicy


class PopularityPolicy(LRUPolicy):
    name = "popularity"
    description = "Fiddler: experts most used on calibration prompts are pinned; the other slots rotate LRU"
    needs_profile = True

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self.profile = np.zeros((num_layers, num_experts), dtype=np.float64)
        self.ranking: list[list[int]] = [list(range(num_experts)) for _ in range(num_layers)]
        self.pinned: list[set[int]] = [set() for _ in range(num_layers)]
        self._unfetched: list[list[int]] = [[] for _ in range(num_layers)]

    def set_profile(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self.profile.shape:
            raise ValueError(f"profile has shape {counts.shape}, this model needs {self.profile.shape}")
        self.profile = counts
        # most popular first; ties by id so the placement is deterministic
        self.ranking = [np.lexsort((np.arange(self.num_experts), -row)).tolist() for row in counts]
        self._repin()

    def set_capacity(self, slots_per_layer: Sequence[int]) -> None:
        super().set_capacity(slots_per_layer)
        self._repin()

    def _repin(self) -> None:
        if not self.profile.any():
            self.pinned = [set() for _ in range(self.num_layers)]
            return
        for layer in range(self.num_layers):
            keep = max(0, self.capacity[layer] - self.top_k)
            ranked = [e for e in self.ranking[layer][:keep] if self.profile[layer, e] > 0]
            self.pinned[layer] = set(ranked)
            self._unfetched[layer] = ranked

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        free = [e for e in candidates if e not in self.pinned[layer]]
        return super().choose_victim(layer, free or candidates)

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        # Bring pinned experts in once (after a profile or a re-plan), in the background.
        wanted: list[tuple[int, int]] = []
        for target in range(self.num_layers):
            if target == layer:
                continue  # this layer's slots are busy right now; its turn comes at the next layer
            todo = [e for e in self._unfetched[target] if e not in self.resident[target]]
            self._unfetched[target] = []
            wanted += [(target, e) for e in todo]
        return wanted

    def admit_prefetch(self, layer: int, expert: int, victim: int) -> bool:
        return victim not in self.pinned[layer]

    def preferred(self, layer: int) -> list[int] | None:
        return self.ranking[layer] if self.profile.any() else None

    def figures(self) -> dict[str, float]:
        pinned = sum(len(p) for p in self.pinned)
        return {"pinned_experts": float(pinned),
                "pinned_resident": float(sum(len(p & r) for p, r in zip(self.pinned, self.resident, strict=True)))}
