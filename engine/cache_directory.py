"""Which expert sits in which slot: the cache's bookkeeping, without any tensors.

Kept apart from the tensors so the trace replayer can run the very same code the engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.policies.base import CachePolicy


class CacheDirectory:
    def __init__(self, slots_per_layer: Sequence[int], policy: CachePolicy) -> None:
        self.policy = policy
        self.slot_of: list[dict[int, int]] = [{} for _ in slots_per_layer]
        self.expert_in: list[list[int]] = [[-1] * n for n in slots_per_layer]

    @property
    def slots_per_layer(self) -> list[int]:
        return [len(s) for s in self.expert_in]

    def resident(self, layer: int) -> list[int]:
        return sorted(self.slot_of[layer])

    def split(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[int]]:
        """Split the needed experts into (resident, missing) and tell the policy about the access."""
        slots = self.slot_of[layer]
        hits = [e for e in experts if e in slots]
        misses = [e for e in experts if e not in slots]
        self.policy.on_access(layer, experts)
        return hits, misses

    def assign(self, layer: int, expert: int, protected: set[int]) -> tuple[int, int]:
        """Give `expert` a slot of `layer`; return (slot, evicted expert or -1).

        Experts in `protected` (needed by the computation in flight) are never evicted.
        """
        slots = self.slot_of[layer]
        row = self.expert_in[layer]
        evicted = -1
        if len(slots) < len(row):
            slot = row.index(-1)
        else:
            candidates = [e for e in slots if e not in protected]
            if not candidates:
                raise RuntimeError(f"layer {layer}: every slot is protected; cannot place expert {expert}")
            evicted = self.policy.choose_victim(layer, candidates)
            slot = slots.pop(evicted)
            self.policy.on_evict(layer, evicted)
        row[slot] = expert
        slots[expert] = slot
        self.policy.on_insert(layer, expert)
        return slot, evicted

    def resize(self, slots_per_layer: Sequence[int]) -> list[dict[int, int]]:
        """Change the slot counts; return, per layer, the kept experts' old slot -> new slot.

        Experts that no longer fit are evicted in the policy's order.
        """
        moves: list[dict[int, int]] = []
        for layer, new_count in enumerate(slots_per_layer):
            slots = self.slot_of[layer]
            while len(slots) > new_count:
                victim = self.policy.choose_victim(layer, list(slots))
                del slots[victim]
                self.policy.on_evict(layer, victim)
            old_slot_of = dict(slots)
            row = [-1] * new_count
            for new_slot, expert in enumerate(sorted(slots, key=slots.__getitem__)):
                row[new_slot] = expert
                slots[expert] = new_slot
            self.expert_in[layer] = row
            moves.append({old_slot_of[e]: slots[e] for e in slots})
        return moves
