"""Evict the expert least likely to be needed at the layer's next step, as the routing so far says.

What separates LRU from Belady on real routing (docs/performance.md, "Policies on real routing"):
an expert's last use is a weak hint on its own. A layer's routing has favourites that drift
within a reply, and the experts one step picks tell which ones the next step tends to pick. So
per layer, the chance that an expert is needed at the next step is estimated from two things
learned online:
- its decayed frequency (uses weighted by `decay` per step of age, as a rate: LFU with decay);
- its first-order transition from the step just routed: how often it followed each of the experts
  just used, pooled over them (a Markov chain of expert sets; counted, never decayed), smoothed
  towards the rate while few transitions are known.
The victim has the lowest `rate + weight * transition`; ties go to the least recently used.

How fast routing drifts differs between layers and along a reply: a decay chosen on a trace's
first tokens was the wrong one later (docs/performance.md). So unless `decay` is given, each
layer keeps the rate for every decay in `DECAYS` and evicts by the one whose rate has predicted
the layer's steps best lately (log-likelihood of the experts each step picked, forgotten by
`memory` per step).

Lossless (eviction only). A token's steps are learned together, in array operations over
[decays, layers, experts], when the token ends or a victim is asked for; the transition counts
take layers x experts^2 float64 (2 MiB at 64 layers x 64 experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.policies.lru import LRUPolicy
from engine.accounting.routing import RoutingStep

DECAYS = (0.9, 0.95, 0.98, 0.99)  # memories of ~10 to ~100 steps


class MarkovPolicy(LRUPolicy):
    name = "markov"
    description = ("the expert least likely at the layer's next step goes: decayed frequency + which experts "
                   "follow the ones just routed, learned online")

    def __init__(self, weight: float = 3.0, decay: float | None = None, memory: float = 0.95) -> None:
        if weight < 0:
            raise ValueError("markov needs weight >= 0 (how much the transitions count beside the frequency)")
        if decay is not None and not 0 < decay < 1:
            raise ValueError("markov needs 0 < decay < 1 (the weight of a use one step older), or no decay to adapt")
        if not 0 <= memory < 1:
            raise ValueError("markov needs 0 <= memory < 1 (how slowly a decay's track record is forgotten)")
        self.weight, self.memory = float(weight), float(memory)
        self.decays = np.array(DECAYS if decay is None else (decay,), dtype=np.float64)

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        variants, side = len(self.decays), num_experts + 1  # expert id `num_experts` pads sets; its counts stay 0
        # Decayed use counts without touching every expert each step: stored = true count / decay^steps,
        # so a step only adds `_growth` (1 / decay^steps) to the experts it used.
        self._uses = np.zeros((variants, num_layers, side))
        self._growth = np.ones((variants, num_layers))
        self._mass = np.zeros((variants, num_layers))  # true decayed uses, summed over experts
        self._follows = np.zeros((num_layers, side, side))  # [layer, from, to]: times `to` followed `from`
        self._leaving = np.zeros((num_layers, side, 2))  # per expert: steps after it, experts in them
        self._follows_flat, self._leaving_flat = self._follows.reshape(-1), self._leaving.reshape(-1, 2)
        self._previous = np.full((num_layers, num_experts), num_experts, dtype=np.int64)  # each layer's latest step
        self._width = np.zeros(num_layers, dtype=np.int64)
        self._skill = np.zeros((variants, num_layers))  # each decay's log-likelihood of the steps, decayed
        self._chance = np.zeros((num_layers, side))  # the estimate, made when a victim is first asked for
        self._fresh = np.zeros(num_layers, dtype=bool)
        self._pending: list[RoutingStep] = []  # steps accessed but not learned from yet
        self._waiting = np.zeros(num_layers, dtype=bool)  # the layers among them

    # ----- learning, a token at a time -----
    def on_request_start(self) -> None:
        super().on_request_start()
        self._learn()
        self._previous[:] = self.num_experts  # a reply's last token says nothing of the next prompt
        self._width[:] = 0
        self._fresh[:] = False

    def on_token_end(self) -> None:
        super().on_token_end()
        self._learn()

    def on_access(self, step: RoutingStep) -> None:
        super().on_access(step)
        # A token's layer-by-layer steps are learned together, so the per-layer path costs about what
        # the whole-token one does.
        if self._pending and (step.experts.shape[1] != self._pending[0].experts.shape[1]
                              or self._waiting[step.layers].any()):
            self._learn()
        self._pending.append(step)
        self._waiting[step.layers] = True

    def _learn(self) -> None:
        if not self._pending:
            return
        steps, self._pending = self._pending, []
        self._waiting[:] = False
        if len(steps) == 1:
            layers, ids = steps[0].layers, steps[0].experts
        else:
            layers, ids = np.concatenate([s.layers for s in steps]), np.concatenate([s.experts for s in steps])
        rows = slice(None) if len(layers) == self.num_layers else layers  # a whole token: views, not copies
        width, none, side = ids.shape[1], self.num_experts, self.num_experts + 1
        before = self._previous[rows, : max(1, int(self._width[rows].max()))]  # [rows, w], padded with `none`
        start = layers[:, None] * side + before  # flat (layer, from)
        self._follows_flat[(start * side)[:, :, None] + ids[:, None, :]] += 1  # (from, to) distinct: no repeats
        self._leaving_flat[start] += (1, width)
        self._follows[rows, none] = self._leaving[rows, none] = 0
        uses = self._uses[:, layers[:, None], ids]
        if len(self.decays) > 1:  # each decay's log-likelihood of these experts, as its rate predicted them
            self._skill[:, rows] *= self.memory
            self._skill[:, rows] += np.log(uses + 1e-300).sum(axis=2)
            self._skill[:, rows] -= width * np.log(self._growth[:, rows] * self._mass[:, rows] + 1e-300)
        self._growth[:, rows] /= self.decays[:, None]
        self._uses[:, layers[:, None], ids] = uses + self._growth[:, rows, None]  # once per step, however many tokens
        self._mass[:, rows] *= self.decays[:, None]
        self._mass[:, rows] += width
        if self._growth[:, rows].max() > 1e100:  # every few thousand steps: back to true counts
            self._uses /= self._growth[:, :, None]
            self._growth[:] = 1
        self._previous[rows] = none
        self._previous[rows, :width] = ids
        self._width[rows] = width
        for step in steps:  # a prompt: the next token follows its last one, not the whole prompt
            if step.last is not None:
                layer, final = int(step.layers[0]), step.last[0]
                self._previous[layer] = none
                self._previous[layer, : len(final)] = final
                self._width[layer] = len(final)
        self._fresh[rows] = False

    # ----- deciding -----
    def decay_in_use(self, layer: int) -> float:
        """The decay whose rate evicts for `layer` now."""
        return float(self.decays[int(np.argmax(self._skill[:, layer]))])

    def chances(self, layer: int) -> np.ndarray:
        """Every expert's estimated chance of being needed at `layer`'s next step (up to scale)."""
        if self._waiting[layer]:  # other layers' pending steps do not change this one's estimate
            self._learn()
        if not self._fresh[layer]:
            v = int(np.argmax(self._skill[:, layer]))
            before = self._previous[layer, : self._width[layer]]
            rate = self._uses[v, layer] * ((1 - self.decays[v]) / self._growth[v, layer])
            follows = self._follows[layer, before].sum(axis=0)
            self._chance[layer] = rate + self.weight * (follows + rate) / (self._leaving[layer, before, 0].sum() + 1)
            self._fresh[layer] = True
        return self._chance[layer]

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        candidates = list(candidates)
        chance = self.chances(layer)[candidates]
        least = np.flatnonzero(chance == chance.min())
        if len(least) == 1:
            return candidates[int(least[0])]
        return super().choose_victim(layer, [candidates[i] for i in least])

    def figures(self) -> dict[str, float]:
        self._learn()
        return {"markov_decay": float(np.mean([self.decay_in_use(layer) for layer in range(self.num_layers)]))}
