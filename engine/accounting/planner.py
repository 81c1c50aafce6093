"""The memory budget's brain: how many expert slots each MoE layer gets (numpy only).

Input: per-layer miss curves, `curves[layer, s]` = expected misses per token of that layer with `s`
slots (see `engine.accounting.miss_curves`; the engine sends the same array to the GUI). Output: slots per
layer for a total, with a floor of top-k slots per layer (one token needs its top-k experts at once).

`planned` allocation gives slots where they remove the most misses: each layer's curve is replaced
by its lower convex hull (so a flat stretch followed by a cliff is seen as the steady gain it
really offers), the hull segments of all layers are sorted by misses removed per slot, and taken
greedily. That is O(layers * experts * log(layers * experts)) and optimal for convex curves.
`uniform` spreads slots evenly, as before any routing is known.

Nothing here imports torch: the GUI calls `estimate` while the budget slider is dragged.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import numpy as np

ALLOCATIONS = ("planned", "uniform")


class ModelGeometry(Protocol):
    """What the planner needs to know about a model (engine.model.layout.MoELayout has all of it)."""

    num_layers: int
    num_experts: int
    top_k: int
    slot_bytes: int


@dataclass(frozen=True)
class Geometry:
    """A model's MoE geometry as plain numbers (for callers without a loaded layout)."""

    num_layers: int
    num_experts: int
    top_k: int
    slot_bytes: int


@dataclass(frozen=True)
class Prediction:
    hit_rate: float
    misses_per_token: float
    bytes_per_token: float


@dataclass(frozen=True)
class BudgetPlan:
    requested_bytes: int
    budget_bytes: int  # what is actually allocated: whole slots
    slots_per_layer: list[int]
    note: str = ""  # said to the user when the request was clamped
    allocation: str = "uniform"  # what was used: planned needs routing history
    prediction: Prediction | None = None  # from the miss curves, when there are any


def uniform_allocation(total_slots: int, num_layers: int, floor: int, ceiling: int) -> list[int]:
    """Spread `total_slots` evenly over layers (earlier layers get the remainder), within [floor, ceiling]."""
    total = max(floor * num_layers, min(total_slots, ceiling * num_layers))
    base, extra = divmod(total, num_layers)
    return [min(ceiling, base + (1 if i < extra else 0)) for i in range(num_layers)]


def _hull_segments(curve: np.ndarray, floor: int) -> tuple[list[int], list[float]]:
    """Lower convex hull of (s, curve[s]) for s >= floor, as segment lengths and misses removed per slot."""
    ys = curve[floor:].tolist()
    hull: list[int] = []  # indices into ys
    for x, y in enumerate(ys):
        while len(hull) >= 2:
            x0, x1 = hull[-2], hull[-1]
            # drop the middle point unless the chain turns counter-clockwise (strictly convex)
            if (x1 - x0) * (y - ys[x0]) - (ys[x1] - ys[x0]) * (x - x0) <= 0:
                hull.pop()
            else:
                break
        hull.append(x)
    lengths = [b - a for a, b in pairwise(hull)]
    gains = [(ys[a] - ys[b]) / (b - a) for a, b in pairwise(hull)]
    return lengths, gains


def planned_allocation(curves: np.ndarray, total_slots: int, floor: int) -> list[int]:
    """Slots per layer that minimise the (hull-)predicted misses for `total_slots` in all."""
    num_layers, width = curves.shape
    num_experts = width - 1
    floor = min(floor, num_experts)
    total = max(floor * num_layers, min(total_slots, num_experts * num_layers))
    slots = np.full(num_layers, floor, dtype=np.int64)
    remaining = total - floor * num_layers
    if remaining <= 0:
        return slots.tolist()
    seg_layer: list[int] = []
    seg_len: list[int] = []
    seg_gain: list[float] = []
    for layer in range(num_layers):
        lengths, gains = _hull_segments(np.asarray(curves[layer], dtype=np.float64), floor)
        seg_layer += [layer] * len(lengths)
        seg_len += lengths
        seg_gain += gains
    layer_of = np.asarray(seg_layer, dtype=np.int64)
    length = np.asarray(seg_len, dtype=np.int64)
    gain = np.asarray(seg_gain, dtype=np.float64)
    order = np.lexsort((np.arange(len(gain)), -gain))  # best gain first; a layer's segments stay in order
    cum = np.cumsum(length[order])
    full = int(np.searchsorted(cum, remaining, side="right"))  # segments that fit whole
    np.add.at(slots, layer_of[order[:full]], length[order[:full]])
    left = remaining - (int(cum[full - 1]) if full else 0)
    if left > 0 and full < len(order):
        slots[layer_of[order[full]]] += left
    return slots.tolist()


def allocate(
    total_slots: int, num_layers: int, num_experts: int, floor: int,
    curves: np.ndarray | None = None, allocation: str = "planned",
) -> tuple[list[int], str]:
    """Slots per layer and the allocation actually used (`planned` falls back to uniform without data)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation '{allocation}'; use one of {', '.join(ALLOCATIONS)}")
    if allocation == "planned" and has_routing(curves):
        return planned_allocation(curves, total_slots, floor), "planned"
    return uniform_allocation(total_slots, num_layers, floor, num_experts), "uniform"


def has_routing(curves: np.ndarray | None) -> bool:
    return curves is not None and bool(np.asarray(curves)[:, 0].sum() > 0)


def predict(curves: np.ndarray, slots_per_layer: list[int] | np.ndarray, slot_bytes: int = 0) -> Prediction:
    """Hit rate, misses and bytes loaded per token that the curves predict for this allocation."""
    slots = np.clip(np.asarray(slots_per_layer, dtype=np.int64), 0, curves.shape[1] - 1)
    misses = float(curves[np.arange(curves.shape[0]), slots].sum())
    accesses = float(curves[:, 0].sum())
    hit_rate = 1.0 - misses / accesses if accesses > 0 else 1.0
    return Prediction(hit_rate, misses, misses * slot_bytes)


def plan_budget(
    geometry: ModelGeometry, requested_bytes: int, *, curves: np.ndarray | None = None, allocation: str = "planned",
) -> BudgetPlan:
    """Clamp the request to [minimum, everything] and split it across MoE layers."""
    from engine.accounting.sizes import format_bytes

    g = geometry
    minimum = g.slot_bytes * g.top_k * g.num_layers
    note = ""
    if requested_bytes < minimum:
        note = (
            f"budget {format_bytes(requested_bytes)} is below this model's minimum "
            f"({format_bytes(minimum)}: {g.top_k} experts per layer); using the minimum"
        )
    total_slots = requested_bytes // g.slot_bytes
    slots, used = allocate(total_slots, g.num_layers, g.num_experts, g.top_k, curves, allocation)
    prediction = predict(curves, slots, g.slot_bytes) if has_routing(curves) else None
    return BudgetPlan(requested_bytes, sum(slots) * g.slot_bytes, slots, note, used, prediction)


def estimate(
    curves: np.ndarray, budget_bytes: int, slot_bytes: int, top_k: int, allocation: str = "planned",
) -> tuple[list[int], Prediction]:
    """For the budget slider: the allocation and predicted hit rate / traffic at `budget_bytes`."""
    num_layers, width = curves.shape
    slots, _ = allocate(budget_bytes // slot_bytes, num_layers, width - 1, top_k, curves, allocation)
    return slots, predict(curves, slots, slot_bytes)
