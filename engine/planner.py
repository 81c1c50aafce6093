"""Turning a byte budget into slots per MoE layer."""

from __future__ import annotations

from dataclasses import dataclass

from engine.layout import MoELayout


@dataclass(frozen=True)
class BudgetPlan:
    requested_bytes: int
    budget_bytes: int  # what is actually allocated: whole slots
    slots_per_layer: list[int]
    note: str = ""  # said to the user when the request was clamped


def uniform_allocation(total_slots: int, num_layers: int, floor: int, ceiling: int) -> list[int]:
    """Spread `total_slots` evenly over layers (earlier layers get the remainder), within [floor, ceiling]."""
    total = max(floor * num_layers, min(total_slots, ceiling * num_layers))
    base, extra = divmod(total, num_layers)
    return [min(ceiling, base + (1 if i < extra else 0)) for i in range(num_layers)]


def plan_budget(layout: MoELayout, requested_bytes: int) -> BudgetPlan:
    """Clamp the request to [minimum, everything] and split it uniformly across MoE layers."""
    from engine.sizes import format_bytes

    note = ""
    if requested_bytes < layout.min_budget_bytes:
        note = (
            f"budget {format_bytes(requested_bytes)} is below this model's minimum "
            f"({format_bytes(layout.min_budget_bytes)}: {layout.top_k} experts per layer); using the minimum"
        )
    total_slots = requested_bytes // layout.slot_bytes
    slots = uniform_allocation(total_slots, layout.num_layers, layout.top_k, layout.num_experts)
    return BudgetPlan(requested_bytes, sum(slots) * layout.slot_bytes, slots, note)
