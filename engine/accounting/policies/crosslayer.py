"""markov's eviction, plus the next layer's experts guessed from this layer's and prefetched.

Why (docs/policies.md): on real routing even a policy that knew each layer's next step exactly
stays far from Belady's loads, and markov is most of the way to that already; what an online
policy can still add is to know a layer's experts *before* its router runs. Within a decode token
the experts layer i picks say a lot about the ones layer i+1 picks. So this policy counts, online
and per pair of consecutive layers, how often expert b ran at layer i+1 in a token with expert a
at layer i. After layer i is routed it guesses each expert's chance at layer i+1 in this token:
markov's own estimate for layer i+1, with the evidence of each expert a just picked added in
log-odds (naive Bayes: logit P(b | a) - logit P(b)). The picks of one layer are not independent
witnesses, so their summed evidence counts as that of at most `witnesses` independent ones.

A guessed expert is prefetched only when its chance beats the victim's (the resident of layer
i+1 with the lowest guessed chance) by `margin`: a prefetch costs a load whether it is used or
not, so with the default 0.9 one is issued only where it wastes, by the guess, under a tenth of a
load on average. Demand misses evict as markov does. The defaults were chosen on the calibration
parts of the real traces (docs/policies.md).

Lossless (prefetch and eviction only). No router lookahead needed: it learns from the routing it
sees, so it works on any model and any trace. Per layer and token: a gather of top-k rows of
experts+1 counts and a few vector operations; the counts take layers x experts^2 float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.base import PredictionScore
from engine.accounting.policies.markov import MarkovPolicy
from engine.accounting.routing import RoutingStep


class CrossLayerPolicy(MarkovPolicy):
    name = "crosslayer"
    description = ("markov's eviction; the next layer's experts guessed from the ones this layer just picked "
                   "(learned online) are prefetched when clearly more likely than what they evict")

    def __init__(self, margin: float = 0.9, witnesses: float = 4.0, prior: float = 2.0, weight: float = 3.0,
                 decay: float | None = None, memory: float = 0.95) -> None:
        super().__init__(weight=weight, decay=decay, memory=memory)
        if not 0 <= margin < 1:
            raise ValueError("crosslayer needs 0 <= margin < 1 (how much likelier a prefetch must be than its victim)")
        if witnesses < 0:
            raise ValueError("crosslayer needs witnesses >= 0 (how many independent picks the layer below's are worth)")
        if prior <= 0:
            raise ValueError("crosslayer needs prior > 0 (how many sightings the plain frequency is worth)")
        self.margin, self.witnesses, self.prior = float(margin), float(witnesses), float(prior)

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        side = num_experts + 1  # expert id `num_experts` pads a narrower set; its counts stay 0
        self._pairs = np.zeros((num_layers, side, side))  # [i, a, b]: b ran at layer i+1 in a token with a at i
        self._pairs_flat = self._pairs.reshape(-1)
        self._seen = np.zeros((num_layers, side))  # [i, a]: decode tokens with a at layer i and layer i+1 known
        self._ran = np.zeros((num_layers, num_experts))  # [i, b]: of those tokens, with b at layer i+1
        self._tokens = np.zeros(num_layers)  # [i]: of those tokens, all
        self._token = np.full((num_layers, num_experts), num_experts, dtype=np.int64)  # this token's experts
        self._token_width = np.zeros(num_layers, dtype=np.int64)
        self._known = np.zeros(num_layers, dtype=bool)  # layers routed in this decode token
        self._guess: dict[int, np.ndarray] = {}  # target layer -> guessed chances, until it is routed
        self.guesses = PredictionScore()
        self._offloaded = False  # does any layer hold fewer slots than experts?

    # ----- learning -----
    def _forget_token(self) -> None:
        self._known[:] = False
        self._guess.clear()
        self.guesses.end_token()

    def on_request_start(self) -> None:
        super().on_request_start()
        self._forget_token()

    def on_token_end(self) -> None:
        super().on_token_end()
        self._forget_token()

    def set_capacity(self, slots_per_layer: Sequence[int]) -> None:
        super().set_capacity(slots_per_layer)
        # With every expert resident nothing is prefetched: learn nothing either, until the budget drops.
        self._offloaded = any(0 < n < self.num_experts for n in self.capacity)
        self._forget_token()

    def on_access(self, step: RoutingStep) -> None:
        super().on_access(step)
        if not self._offloaded:
            return
        layers, ids = step.layers, step.experts
        last = int(layers[-1])
        if self._guess:
            for layer in layers.tolist():
                self._guess.pop(layer, None)
        self._known[last + 1:] = False  # layers come in order: any later one is the last token's
        if step.tokens != 1:  # a prompt's union of experts says little of which ones go together
            self._known[layers] = False
            return
        if self.guesses.pending:
            for layer, experts, _ in step.rows():
                self.guesses.observe(layer, experts)
        width, none, side = ids.shape[1], self.num_experts, self.num_experts + 1
        self._token[layers, :width] = ids
        self._token[layers, width:] = none
        self._token_width[layers] = width
        self._known[layers] = True
        paired = (layers > 0) & self._known[layers - 1]  # the layer below was routed in this token
        if not paired.any():
            return
        under, ids = layers[paired] - 1, ids[paired]
        below = self._token[under, : max(1, int(self._token_width[under].max()))]
        start = under[:, None] * side + below
        self._pairs_flat[(start * side)[:, :, None] + ids[:, None, :]] += 1  # distinct (a, b): no repeats
        self._seen.reshape(-1)[start] += 1
        self._pairs[under, none] = self._seen[under, none] = 0  # the padding id learns nothing
        self._ran[under[:, None], ids] += 1
        self._tokens[under] += 1

    # ----- guessing and prefetching -----
    def guess(self, layer: int) -> np.ndarray:
        """Each expert's chance of running at `layer` in this token, from the layer below's picks."""
        experts, k, prior, below_layer = self.num_experts, self.top_k, self.prior, layer - 1
        own = self.chances(layer)[:experts]
        total = own.sum()
        own = own * (k / total) if total > 0 else np.full(experts, k / experts)  # about top-k in all
        # markov's estimate ranks well but is no calibrated chance (right after a prompt it favours the
        # experts the prompt's load waves pushed out): alone it never makes a prefetch worth more than even.
        own = np.minimum(own, 0.5)
        below = self._token[below_layer, : self._token_width[below_layer]]
        base = (self._ran[below_layer] + prior * k / experts) / (self._tokens[below_layer] + prior)
        given = (self._pairs[below_layer, below, :experts] + prior * base) / (self._seen[below_layer, below, None] + prior)
        trust = min(1.0, self.witnesses / len(below))
        odds = _logit(own) + trust * (_logit(given) - _logit(base)).sum(axis=0)
        return 1 / (1 + np.exp(-odds))

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        target = layer + 1
        if (target >= self.num_layers or not self._known[layer] or self._known[target]
                or not 0 < self.capacity[target] < self.num_experts):
            return []
        chance = self.guess(target)
        self._guess[target] = chance
        self.guesses.expect(target, np.argpartition(-chance, self.top_k - 1)[: self.top_k].tolist())
        resident = self.resident[target]
        floor = min((chance[e] for e in resident), default=0.0) if len(resident) >= self.capacity[target] else 0.0
        wanted = np.flatnonzero(chance > floor + self.margin)
        wanted = wanted[np.argsort(-chance[wanted], kind="stable")]
        return [(target, int(e)) for e in wanted if int(e) not in resident]

    def admit_prefetch(self, layer: int, expert: int, victim: int) -> bool:
        chance = self._guess.get(layer)
        return chance is not None and chance[expert] > chance[victim] + self.margin

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        chance = self._guess.get(layer)
        if chance is None:  # a demand miss: the layer's next step, as markov sees it
            return super().choose_victim(layer, candidates)
        candidates = list(candidates)
        return candidates[int(np.argmin(chance[candidates]))]

    def figures(self) -> dict[str, float]:
        return super().figures() | {"crosslayer_recall": self.guesses.accuracy,
                                    "crosslayer_precision": self.guesses.precision}


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-3, 1 - 1e-3)  # a count of zero is not certainty
    return np.log(p / (1 - p))
