"""SwapMoE (Kong et al. 2024) virtual experts. LOSSY: it changes what the model computes.

Each layer keeps its most important experts resident and the router may only choose among them
(the runtime installs a forward hook on each router, `engine.decode.routers`, which masks the other
experts' logits and renormalises: see `engine.decode.routers.restrict_routing`). Importance is the
router's probability mass per expert over recent tokens (exponentially decayed). Every
`interval` tokens the resident set is re-chosen: the top experts by importance, as many as the
layer has slots; newcomers are loaded in the background as speculative loads while the old set
keeps serving, so a swap never stalls a token.

Trace replay cannot re-route recorded tokens; it replays the swapping schedule and reports
`rerouted` (router choices that were not resident and so were replaced) instead of misses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.base import CachePolicy


class SwapMoEPolicy(CachePolicy):
    name = "swapmoe"
    lossless = False
    restricts_routing = True
    description = "LOSSY: SwapMoE virtual experts; each layer routes only among its resident, most important experts"

    def __init__(self, interval: int = 8, decay: float = 0.9) -> None:
        self.interval, self.decay = max(1, int(interval)), float(decay)

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self.importance = np.zeros((num_layers, num_experts))
        self._last_use = np.zeros((num_layers, num_experts))
        self._clock = 0
        self._due: list[tuple[int, int]] = []
        self.swaps = 0
        self.rerouted = 0
        self.routed = 0

    def on_router_scores(self, layer: int, scores: np.ndarray) -> None:
        self.importance[layer] += scores

    def on_layer_access(self, layer: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        self._clock += 1
        self._last_use[layer, list(experts)] = self._clock

    def note_rerouted(self, changed: int, total: int) -> None:
        """Router choices that were replaced because they were not resident (from the routing hook)."""
        self.rerouted += changed
        self.routed += total

    def on_token_end(self) -> None:
        super().on_token_end()
        self.importance *= self.decay
        if self.step == 1 or self.step % self.interval == 0:  # right after the prefill, then periodically
            self._plan_swaps()

    def _plan_swaps(self) -> None:
        self._due = []
        for layer in range(self.num_layers):
            row = self.importance[layer]
            order = np.lexsort((np.arange(self.num_experts), -row))
            wanted = [int(e) for e in order[: self.capacity[layer]] if row[e] > 0]
            self._due += [(layer, e) for e in wanted if e not in self.resident[layer]]
        self.swaps += len(self._due)

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        imp, last = self.importance[layer], self._last_use[layer]
        return min(candidates, key=lambda e: (imp[e], last[e]))

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        due, self._due = self._due, []
        return due

    def admit_prefetch(self, layer: int, expert: int, victim: int) -> bool:
        return bool(self.importance[layer, expert] > self.importance[layer, victim])

    def figures(self) -> dict[str, float]:
        return {"swaps": float(self.swaps), "rerouted_share": self.rerouted / self.routed if self.routed else 0.0}
