"""MoE-Infinity (Xue et al. 2024): expert activation matrices rank eviction and prefetching.

- iteration-level EAM: [layers, experts] tokens routed to each expert in the current forward step;
- request-level EAM (rEAM): the same, summed over the current request;
- EAMC: a bounded collection of past requests' rEAMs. When it is full, a finished request replaces
  the most similar stored matrix (smallest cosine distance), so the collection keeps diverse
  request types instead of many copies of the commonest one.

After every layer the current rEAM is matched against the collection (cosine similarity, updated
incrementally). A layer's activation likelihood blends the current request's own distribution
with the matched past request's; it drives:
- eviction: the lowest priority goes, priority = likelihood * (1 - layer / layers) (the paper's
  layer decay: early layers have least time to be prefetched). With per-layer slot pools the decay
  is a constant within a layer, so it cannot reorder one layer's victims; it is kept so the
  priorities mean what the paper's do, and it orders prefetches across layers.
- prefetching: the likeliest top-k experts of the next `depth` layers, nearer layers first; a
  prefetch only evicts an expert of lower priority.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.base import CachePolicy, PredictionScore


class EAMPolicy(CachePolicy):
    name = "eam"
    description = "MoE-Infinity: request activation matrices, matched against past requests, rank eviction and prefetch"

    def __init__(self, collection_size: int = 32, depth: int = 3, blend: float = 0.5) -> None:
        self.collection_size, self.depth, self.blend = int(collection_size), int(depth), float(blend)

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        shape = (num_layers, num_experts)
        self.request_eam = np.zeros(shape)
        self.iteration_eam = np.zeros(shape)
        self.collection = np.zeros((self.collection_size, *shape))
        self.collection_norm = np.zeros(self.collection_size)
        self.collection_len = 0
        self._dots = np.zeros(self.collection_size)  # request_eam . collection[c], kept up to date
        self._norm2 = 0.0
        self.match = -1
        self.match_similarity = 0.0
        self._last_use = np.zeros(shape)
        self._clock = 0
        self.score = PredictionScore()
        self.matched_predictions = 0
        self.predictions = 0
        self.requests_stored = 0

    # ----- the collection -----
    def on_request_start(self) -> None:
        if self.request_eam.any():
            self._remember(self.request_eam.copy())
        self.request_eam[:] = 0
        self._dots[:] = 0
        self._norm2 = 0.0
        self.match, self.match_similarity = -1, 0.0

    def _remember(self, eam: np.ndarray) -> None:
        if self.collection_size == 0:
            return
        norm = float(np.linalg.norm(eam))
        if self.collection_len < self.collection_size:
            slot = self.collection_len
            self.collection_len += 1
        else:
            sims = self._similarities(eam, norm)
            slot = int(np.argmax(sims))  # replace the most similar: keep the collection diverse
        self.collection[slot] = eam
        self.collection_norm[slot] = norm
        self.requests_stored += 1

    def _similarities(self, eam: np.ndarray, norm: float) -> np.ndarray:
        n = self.collection_len
        dots = self.collection[:n].reshape(n, -1) @ eam.reshape(-1)
        return dots / np.maximum(self.collection_norm[:n] * norm, 1e-12)

    # ----- observing -----
    def on_layer_access(self, layer: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        ids = np.asarray(experts, dtype=np.int64)
        delta = np.asarray(counts, dtype=np.float64)
        old = self.request_eam[layer, ids]
        self._norm2 += float(((old + delta) ** 2 - old**2).sum())
        self.request_eam[layer, ids] += delta
        self.iteration_eam[layer, ids] += delta
        n = self.collection_len
        if n:
            self._dots[:n] += self.collection[:n, layer][:, ids] @ delta
            sims = self._dots[:n] / np.maximum(self.collection_norm[:n] * np.sqrt(self._norm2), 1e-12)
            best = int(np.argmax(sims))
            self.match, self.match_similarity = (best, float(sims[best])) if sims[best] > 0 else (-1, 0.0)
        self._clock += 1
        self._last_use[layer, ids] = self._clock
        self.score.observe(layer, experts)

    def on_token_end(self) -> None:
        super().on_token_end()
        self.iteration_eam[:] = 0
        self.score.end_token()

    # ----- predicting -----
    def likelihood(self, layer: int) -> np.ndarray:
        """Predicted share of this layer's routing that goes to each expert for the rest of the request."""
        own = self.request_eam[layer]
        own = own / own.sum() if own.any() else None
        past = self.collection[self.match, layer] if self.match >= 0 else None
        past = past / past.sum() if past is not None and past.any() else None
        if own is not None and past is not None:
            return self.blend * own + (1 - self.blend) * past
        for one in (past, own):
            if one is not None:
                return one
        return np.zeros(self.num_experts)

    def priority(self, layer: int) -> np.ndarray:
        return self.likelihood(layer) * (1.0 - layer / self.num_layers)

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        prio, last = self.priority(layer), self._last_use[layer]
        return min(candidates, key=lambda e: (prio[e], last[e]))

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        ranked: list[tuple[float, int, int]] = []
        for d in range(1, self.depth + 1):
            target = layer + d
            if target >= self.num_layers:
                break
            p = self.likelihood(target)
            top = [int(e) for e in np.argsort(-p, kind="stable")[: self.top_k] if p[e] > 0]
            if not top:
                continue
            self.predictions += 1
            self.matched_predictions += self.match >= 0
            if d == 1:
                self.score.expect(target, top)
            decay = 1.0 - (d - 1) / self.depth  # nearer layers are needed sooner
            ranked += [(float(p[e]) * decay, target, e) for e in top]
        ranked.sort(key=lambda r: -r[0])
        return [(target, e) for _, target, e in ranked]

    def admit_prefetch(self, layer: int, expert: int, victim: int) -> bool:
        prio = self.priority(layer)
        return bool(prio[expert] > prio[victim])

    def figures(self) -> dict[str, float]:
        return {
            "eamc_size": float(self.collection_len),
            "eamc_requests_stored": float(self.requests_stored),
            "eamc_matched_predictions": float(self.matched_predictions),
            "eamc_match_share": self.matched_predictions / self.predictions if self.predictions else 0.0,
            "eamc_similarity": self.match_similarity,
            "prediction_accuracy": self.score.accuracy,
        }
