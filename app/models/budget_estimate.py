"""The budget slider's live estimate, from the engine's per-layer miss curves and `engine.accounting.planner`.

The planner (numpy only) gives the allocation and the predicted hit rate for any budget. Tokens/s
is scaled from what was measured: the compute part of a token stays, the stall part grows or
shrinks with the predicted misses. Without the planner, or before any routing was recorded, or
without a measured reply, the panel says there is no estimate rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import protocol as p


@dataclass(frozen=True)
class Estimate:
    budget_bytes: int
    slots_per_layer: list[int]
    hit_rate: float
    misses_per_token: float
    tokens_per_s: float | None = None


def _planner():
    try:
        from engine.accounting import planner
    except Exception:  # missing or broken: no estimate, never a crash
        return None
    return planner if hasattr(planner, "estimate") and hasattr(planner, "predict") else None


def slot_bytes_of(model: p.ModelLoaded) -> int:
    """One slot as the engine allocates it (the expert, aligned): the minimum is top-k slots per layer."""
    per_minimum = model.top_k * model.num_layers
    return model.min_budget_bytes // per_minimum if per_minimum else model.expert_bytes


def scaled_tokens_per_s(measured_tps: float, stall_s: float, misses_now: float, misses_then: float) -> float | None:
    """Tokens/s if the stall part of each token scales with the misses per token."""
    if measured_tps <= 0:
        return None
    if misses_now <= 0:  # nothing stalls now: only "no misses then either" can be predicted
        return measured_tps if misses_then <= 0 else None
    per_token = 1.0 / measured_tps
    compute = max(per_token - stall_s, 1e-9)
    return 1.0 / (compute + stall_s * misses_then / misses_now)


class Estimator:
    """Estimates for one model, remembering the planner's answers until the curves change.

    The planner walks every layer's curve (milliseconds at 64 x 256), so a slider drag or the
    10 Hz refresh must not recompute what it already knows.
    """

    MAX_REMEMBERED = 512

    def __init__(self) -> None:
        self._curves_key: int | None = None
        self._plans: dict[int, tuple[list[int], object]] = {}
        self._now: dict[tuple[int, ...], object] = {}

    def __call__(self, budget_bytes: int, model: p.ModelLoaded | None,
                 snapshot: p.TelemetrySnapshot | None) -> Estimate | None:
        planner = _planner()
        if planner is None or model is None or snapshot is None or snapshot.miss_curves is None:
            return None
        key = hash(snapshot.miss_curves.data)
        if key != self._curves_key:
            self._curves_key, self._plans, self._now = key, {}, {}
        curves = snapshot.miss_curves.numpy()
        if curves.ndim != 2 or not planner.has_routing(curves):
            return None
        slot_bytes = slot_bytes_of(model)
        if budget_bytes not in self._plans:
            if len(self._plans) >= self.MAX_REMEMBERED:
                self._plans.clear()
            self._plans[budget_bytes] = planner.estimate(curves, budget_bytes, slot_bytes, model.top_k)
        slots, prediction = self._plans[budget_bytes]
        current = tuple(snapshot.slots_per_layer)
        if current not in self._now:
            self._now[current] = planner.predict(curves, list(current), slot_bytes)
        now = self._now[current]
        tps = scaled_tokens_per_s(snapshot.decode_tokens_per_s, snapshot.stall_s_per_token,
                                  now.misses_per_token, prediction.misses_per_token)
        return Estimate(budget_bytes, list(slots), prediction.hit_rate, prediction.misses_per_token, tps)
