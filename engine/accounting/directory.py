"""Which expert sits in which slot: the cache's bookkeeping, without any tensors or threads.

Kept apart from the tensors so the trace replayer runs the very same code the engine runs. A slot
holds an expert that is either ready (its bytes are in) or pending (a load is writing it). The
rules that keep offloading exact live here:
- an expert needed by the computation in flight (`protected`) is never evicted;
- a pending expert is never evicted (its slot is being written) - a load is cancelled first
  (`abort`), by the cache, never silently overwritten;
- a prefetch never takes a slot from a protected expert, and only evicts what the policy admits.

It also counts what prefetching achieved, for every policy alike: prefetches issued, used in
time (`prefetch_hits`), used while still loading (`prefetch_late`), evicted unused (`wasted`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.accounting.policies.base import CachePolicy
from engine.accounting.routing import RoutingStep


class NoFreeSlotError(RuntimeError):
    """Every slot of a layer is protected or still loading."""


@dataclass
class Lookup:
    """One layer's needs for one step, split by where each expert is."""

    ready: list[int]  # resident, bytes in: compute first
    inflight: list[int]  # slot assigned, load still running: compute next
    missing: list[int]  # not resident: load, then compute
    prefetch_hits: list[int] = field(default_factory=list)  # ready thanks to a prefetch (first use)


@dataclass
class PrefetchStats:
    issued: int = 0
    hits: int = 0  # needed and ready in time
    late: int = 0  # needed while its load was still running
    wasted: int = 0  # evicted or cancelled before it was ever needed

    def as_dict(self) -> dict[str, float]:
        return {
            "prefetch_issued": float(self.issued),
            "prefetch_hits": float(self.hits),
            "prefetch_late": float(self.late),
            "prefetch_wasted": float(self.wasted),
            # ProMoE's GOODPRED: prefetched experts that were used, and in time
            "goodpred": self.hits / self.issued if self.issued else 0.0,
        }


class CacheDirectory:
    def __init__(self, slots_per_layer: Sequence[int], policy: CachePolicy) -> None:
        self.slot_of: list[dict[int, int]] = [{} for _ in slots_per_layer]
        self.expert_in: list[list[int]] = [[-1] * n for n in slots_per_layer]
        self.pending: list[set[int]] = [set() for _ in slots_per_layer]
        self.unused_prefetch: list[set[int]] = [set() for _ in slots_per_layer]
        self.prefetch = PrefetchStats()
        self.policy = policy
        self.changes = 0  # counts placements, evictions and resizes: which expert sits where may differ
        policy.outcomes = self.prefetch
        policy.set_capacity(self.slots_per_layer)

    # ----- facts -----
    @property
    def slots_per_layer(self) -> list[int]:
        return [len(s) for s in self.expert_in]

    def resident(self, layer: int) -> list[int]:
        return sorted(self.slot_of[layer])

    def ready(self, layer: int) -> list[int]:
        return sorted(e for e in self.slot_of[layer] if e not in self.pending[layer])

    def any_pending(self) -> bool:
        return any(self.pending)

    def set_policy(self, policy: CachePolicy) -> None:
        """Hand the cache to another policy (already `reset`), telling it what is resident."""
        policy.outcomes = self.prefetch
        policy.set_capacity(self.slots_per_layer)
        for layer, slots in enumerate(self.slot_of):
            for expert in sorted(slots, key=slots.__getitem__):
                policy.on_insert(layer, expert)
        self.policy = policy

    # ----- one routing step -----
    def lookup(self, step: RoutingStep) -> list[Lookup]:
        """Split each row's needed experts by where they are, and tell the policy about the access
        (one layer of a step, or every layer of a decode token: the same code)."""
        found = [self._split(layer, experts) for layer, experts in zip(step.layers.tolist(), step.experts.tolist(),
                                                                        strict=True)]
        self.policy.on_access(step)
        return found

    def _split(self, layer: int, experts: list[int]) -> Lookup:
        slots, pending, unused = self.slot_of[layer], self.pending[layer], self.unused_prefetch[layer]
        result = Lookup([], [], [])
        for e in experts:
            if e not in slots:
                result.missing.append(e)
                continue
            (result.inflight if e in pending else result.ready).append(e)
            if e in unused:
                unused.discard(e)
                if e in pending:
                    self.prefetch.late += 1
                else:
                    self.prefetch.hits += 1
                    result.prefetch_hits.append(e)
        return result

    def assign(self, layer: int, expert: int, protected: Iterable[int], *, pending: bool = False) -> tuple[int, int]:
        """Give `expert` a slot of `layer`; return (slot, evicted expert or -1).

        Experts in `protected` (needed by the computation in flight) and pending experts are never
        evicted; `NoFreeSlotError` says every slot is one of those.
        """
        slot, evicted = self._take_slot(layer, self._candidates(layer, protected))
        self._place(layer, expert, slot, pending)
        return slot, evicted

    def place_prefetches(
        self, wanted: Iterable[tuple[int, int]], protected: dict[int, set[int]]
    ) -> list[tuple[int, int, int]]:
        """Give slots to the experts the policy wants loaded speculatively; return (layer, expert, slot).

        Already resident or loading experts are skipped; a full layer only evicts an unprotected,
        ready expert that the policy agrees to trade (`admit_prefetch`).
        """
        placed: list[tuple[int, int, int]] = []
        for layer, expert in wanted:
            if expert in self.slot_of[layer] or not self.expert_in[layer]:
                continue
            candidates = self._candidates(layer, protected.get(layer, ()))
            if len(self.slot_of[layer]) >= len(self.expert_in[layer]):
                if not candidates:
                    continue
                victim = self.policy.choose_victim(layer, candidates)
                if not self.policy.admit_prefetch(layer, expert, victim):
                    continue
                candidates = [victim]
            slot, _ = self._take_slot(layer, candidates)
            self._place(layer, expert, slot, pending=True)
            self.unused_prefetch[layer].add(expert)
            self.prefetch.issued += 1
            placed.append((layer, expert, slot))
        return placed

    def wave_order(self, layer: int, needed: Sequence[int], missing: Sequence[int]) -> tuple[list[int], set[int]]:
        """For a step that needs more of `layer`'s experts than fit beside the resident ones: the order
        to stream `missing` through the slots, least wanted first (the policy's victims in turn over
        `needed`), and the needed resident experts to hold through the waves: those among the
        slots' worth the policy wants most, at most half the slots (so that a wave still streams
        through the other half). What stays after the step is then the policy's choice, not the
        last wave in id order."""
        pool, order = list(needed), []
        while pool:
            victim = self.policy.choose_victim(layer, pool)
            order.append(victim)
            pool.remove(victim)
        capacity, lost, slots = len(self.expert_in[layer]), set(missing), self.slot_of[layer]
        held = [e for e in reversed(order[-capacity:]) if e in slots and e not in lost][: capacity // 2]
        return [e for e in order if e in lost], set(held)

    def complete(self, layer: int, expert: int) -> None:
        """The load of `expert` finished: its bytes are in."""
        self.pending[layer].discard(expert)

    def abort(self, layer: int, expert: int) -> None:
        """The load of `expert` was cancelled: free its slot (its bytes are garbage)."""
        self.pending[layer].discard(expert)
        self._evict(layer, expert)

    def drop_all(self, layer: int) -> None:
        """Evict every settled expert of `layer` (the benchmark's no-cache baseline)."""
        for expert in [e for e in self.slot_of[layer] if e not in self.pending[layer]]:
            self._evict(layer, expert)

    # ----- internals -----
    def _candidates(self, layer: int, protected: Iterable[int]) -> list[int]:
        keep = set(protected) | self.pending[layer]
        return [e for e in self.slot_of[layer] if e not in keep]

    def _take_slot(self, layer: int, candidates: list[int]) -> tuple[int, int]:
        row = self.expert_in[layer]
        if len(self.slot_of[layer]) < len(row):
            return row.index(-1), -1
        if not candidates:
            raise NoFreeSlotError(f"layer {layer}: every slot is protected or loading")
        victim = candidates[0] if len(candidates) == 1 else self.policy.choose_victim(layer, candidates)
        slot = self.slot_of[layer][victim]
        self._evict(layer, victim)
        return slot, victim

    def _place(self, layer: int, expert: int, slot: int, pending: bool) -> None:
        self.changes += 1
        self.expert_in[layer][slot] = expert
        self.slot_of[layer][expert] = slot
        if pending:
            self.pending[layer].add(expert)
        self.policy.on_insert(layer, expert)

    def _evict(self, layer: int, expert: int) -> None:
        self.changes += 1
        slot = self.slot_of[layer].pop(expert)
        self.expert_in[layer][slot] = -1
        if expert in self.unused_prefetch[layer]:
            self.unused_prefetch[layer].discard(expert)
            self.prefetch.wasted += 1
        self.policy.on_evict(layer, expert)

    def resize(self, slots_per_layer: Sequence[int]) -> list[dict[int, int]]:
        """Change the slot counts; return, per layer, the kept experts' old slot -> new slot.

        Experts that no longer fit are evicted in the policy's order. No load may be pending.
        """
        if self.any_pending():
            raise RuntimeError("resize with loads in flight; settle them first")
        self.changes += 1
        self.policy.set_capacity(slots_per_layer)
        moves: list[dict[int, int]] = []
        for layer, new_count in enumerate(slots_per_layer):
            slots = self.slot_of[layer]
            while len(slots) > new_count:
                self._evict(layer, self.policy.choose_victim(layer, list(slots)))
            old_slot_of = dict(slots)
            row = [-1] * new_count
            for new_slot, expert in enumerate(sorted(slots, key=slots.__getitem__)):
                row[new_slot] = expert
                slots[expert] = new_slot
            self.expert_in[layer] = row
            moves.append({old_slot_of[e]: slots[e] for e in slots})
        return moves
