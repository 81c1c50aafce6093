"""ProMoE (Song et al. 2024) on top of LRU: predict a few layers ahead, prefetch, pre-empt.

Predictor: the sliding window of Mixtral-offloading's speculative loading, widened to a stride
`k`: at layer i, layer i+k's own router is applied to layer i's hidden state (at layer 0 also for
layers 1..k-1, so every layer gets a guess). The guessed experts are prefetched as speculative
loads. The cache's load queue (`engine.offload.loads`) provides the rest of ProMoE's machinery: two
priorities, exact misses (known right after a layer's gate) pre-empting speculative loads at
chunk (weight matrix) granularity, and execution order resident -> in flight -> not started.

Stats: `prediction_accuracy` (share of needed experts that were predicted) here; the cache adds
`goodpred` (prefetched experts used in time / prefetches issued).
"""

from __future__ import annotations

from engine.accounting.policies.base import PredictionScore
from engine.accounting.policies.lru import LRUPolicy
from engine.accounting.routing import RoutingStep


class ProMoEPolicy(LRUPolicy):
    name = "promoe"
    description = "ProMoE: layer i+k's router on layer i's hidden state predicts experts; prefetched at low priority"

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError("promoe needs k >= 1 (how many layers ahead to predict)")
        self.k = int(k)
        self.lookahead = self.k

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self.score = PredictionScore()
        self._wanted: list[tuple[int, int]] = []
        self.predicted_sets = 0

    def targets(self, layer: int) -> list[int]:
        first = range(1, min(self.k, self.num_layers)) if layer == 0 else ()
        return [t for t in (*first, layer + self.k) if t < self.num_layers]

    def on_prediction(self, layer: int, predicted: dict[int, list[int]]) -> None:
        for target in self.targets(layer):
            experts = predicted.get(target)
            if experts is None:
                continue  # e.g. a trace recorded with a shorter window
            self.predicted_sets += 1
            self.score.expect(target, experts)
            self._wanted += [(target, e) for e in experts]

    def on_access(self, step: RoutingStep) -> None:
        super().on_access(step)
        for layer, experts, _ in step.rows():
            self.score.observe(layer, experts)

    def on_token_end(self) -> None:
        super().on_token_end()
        self.score.end_token()

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        wanted, self._wanted = self._wanted, []
        return wanted

    def figures(self) -> dict[str, float]:
        return {"prediction_accuracy": self.score.accuracy, "prediction_precision": self.score.precision,
                "predicted_sets": float(self.predicted_sets)}
