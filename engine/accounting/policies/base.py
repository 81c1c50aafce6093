"""The interface every cache policy implements.

A policy sees expert ids only, never tensors or threads. `engine.accounting.directory.CacheDirectory`
calls it, and the same directory + policy run inside the engine (`engine.offload.expert_cache.ExpertCache`) and
in the trace replayer (`engine.traces.replay`), so a replay reports what the engine would do.

Hook order per MoE layer and forward step:
  `on_access` (the router's choice is known; one layer, or every layer of a decode token) -> `on_prediction` (only if `lookahead` > 0) ->
  `choose_victim` / `on_insert` / `on_evict` for each miss -> `prefetch` (what to load for later)
  -> `admit_prefetch` / `choose_victim` / `on_insert` per prefetch.
Between steps `on_token_end`; at the start of a reply `on_request_start`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.accounting.routing import RoutingStep


class CachePolicy:
    """Decides evictions and, optionally, prefetches for a per-layer expert cache."""

    name = "base"
    lossless = True  # False: the policy changes the model's output (see `restricts_routing`)
    description = ""
    # Routing predictions wanted: `on_prediction` gets, for layer i, the experts that layer i+d's
    # router picks on layer i's hidden state, for d = 1..lookahead.
    lookahead = 0
    # True: the router may only choose among resident experts (lossy; the runtime installs a hook).
    restricts_routing = False
    # True: the policy wants a calibration profile ([layers, experts] routing counts), see `set_profile`.
    needs_profile = False

    @property
    def prefetches(self) -> bool:
        """Does this policy ever prefetch? (The cache skips asking, per layer, when it does not.)"""
        return type(self).prefetch is not CachePolicy.prefetch

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.step = 0
        self.resident: list[set[int]] = [set() for _ in range(num_layers)]
        self.capacity: list[int] = [0] * num_layers

    # ----- lifecycle -----
    def on_request_start(self) -> None:
        """A new request (reply) begins."""

    def on_token_end(self) -> None:
        self.step += 1

    def set_capacity(self, slots_per_layer: Sequence[int]) -> None:
        """The slot count of every layer (at start and after each re-plan)."""
        self.capacity = list(slots_per_layer)

    def set_profile(self, counts: np.ndarray) -> None:
        """A calibration profile: [layers, experts] routing counts (for `needs_profile` policies)."""

    # ----- what happened -----
    def on_access(self, step: RoutingStep) -> None:
        """The experts each layer of `step` uses now (one layer of a forward step, or every layer of a
        decode token at once, in layer order). Policies that can take a whole step in array
        operations override this; the others override `on_layer_access`, called here per layer."""
        for layer, experts, counts in step.rows():
            self.on_layer_access(layer, experts, counts)

    def on_layer_access(self, layer: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        """`experts` (sorted, unique) are used by layer `layer` now; `counts[i]`: tokens routed to experts[i]."""

    def on_prediction(self, layer: int, predicted: dict[int, list[int]]) -> None:
        """At layer `layer`: `predicted[target]` are the experts layer `target`'s router picks on this hidden state."""

    def on_router_scores(self, layer: int, scores: np.ndarray) -> None:
        """Routing mass per expert ([experts], summed over this step's tokens), for importance-based policies."""

    def on_insert(self, layer: int, expert: int) -> None:
        """`expert` was given a slot in `layer` (its bytes may still be loading)."""
        self.resident[layer].add(expert)

    def on_evict(self, layer: int, expert: int) -> None:
        """`expert` left `layer`'s cache."""
        self.resident[layer].discard(expert)

    # ----- decisions -----
    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        """Pick which of the resident `candidates` of `layer` to evict."""
        raise NotImplementedError

    def prefetch(self, layer: int) -> list[tuple[int, int]]:
        """After layer `layer` is routed: (layer, expert) pairs to load speculatively, most wanted first."""
        return []

    def admit_prefetch(self, layer: int, expert: int, victim: int) -> bool:
        """Is prefetching `expert` worth evicting `victim` (chosen by `choose_victim`)?"""
        return True

    def preferred(self, layer: int) -> list[int] | None:
        """Experts to fill `layer`'s free slots with at load, best first (None: in id order)."""
        return None

    # ----- figures -----
    outcomes = None  # the driving CacheDirectory's PrefetchStats (it attaches them)

    def stats(self) -> dict[str, float]:
        """What telemetry shows for this policy (`TelemetrySnapshot.extra`): prefetch outcomes, when the
        policy prefetches, and its own figures."""
        prefetching = type(self).prefetch is not CachePolicy.prefetch
        shared = self.outcomes.as_dict() if prefetching and self.outcomes is not None else {}
        return shared | self.figures()

    def figures(self) -> dict[str, float]:
        """Policy-specific figures (prediction accuracy, collection size, ...)."""
        return {}


class PredictionScore:
    """How well predicted expert sets matched the experts actually used (recall over all predictions)."""

    def __init__(self) -> None:
        self.pending: dict[int, set[int]] = {}  # target layer -> predicted experts, this token
        self.predicted = 0
        self.correct = 0
        self.needed = 0

    def expect(self, layer: int, experts: Sequence[int]) -> None:
        self.pending.setdefault(layer, set()).update(experts)

    def observe(self, layer: int, experts: Sequence[int]) -> None:
        guess = self.pending.pop(layer, None)
        if guess is None:
            return
        self.predicted += len(guess)
        self.needed += len(experts)
        self.correct += len(guess.intersection(experts))

    def end_token(self) -> None:
        self.pending.clear()

    @property
    def accuracy(self) -> float:
        """Share of the needed experts that had been predicted (ProMoE's prediction accuracy)."""
        return self.correct / self.needed if self.needed else 0.0

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0
