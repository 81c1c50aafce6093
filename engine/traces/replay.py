"""Trace replay: run a recorded routing trace through a policy and the engine's own CacheDirectory.

Per step and layer it calls the directory and the policy in the engine's order (lookup ->
predictions -> exact loads -> prefetches -> waves), so the hit rate it reports is the one the
engine would see. What it does not model is time: a prefetch is assumed to arrive before it is
needed (the engine measures lateness live: `prefetch_late`). Loads at warm-up are not counted, as
in the engine.

Next to every online policy it runs Belady's MIN (offline optimal eviction, `BeladyPolicy`) with
the same slots: no demand-loading policy can load fewer experts. A prefetching policy can show a
higher hit rate than MIN (its prefetches are not misses), but never fewer loads in total.
numpy only; no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from engine.accounting.directory import CacheDirectory
from engine.accounting.miss_curves import MissCurveRecorder
from engine.accounting.planner import allocate, predict
from engine.accounting.policies import make_policy
from engine.accounting.policies.base import CachePolicy
from engine.accounting.policies.belady import BeladyPolicy
from engine.accounting.routing import RoutingStep
from engine.accounting.sizes import BudgetSpec
from engine.traces.trace import Trace, steps_by_boundary


@dataclass
class ReplayResult:
    policy: str
    slots_per_layer: list[int]
    tokens: int
    accesses: int = 0  # expert uses (one per needed expert per layer per step)
    hits: int = 0  # resident when needed (whatever brought it in)
    misses: int = 0  # loaded on demand
    prefetch_loads: int = 0
    prefetch_hits: int = 0  # hits that a prefetch brought in
    rerouted: int = 0  # lossy policies: router choices replaced because they were not resident
    expert_bytes: int | None = None
    extra: dict[str, float] = field(default_factory=dict)  # the policy's own figures

    @property
    def loads(self) -> int:
        return self.misses + self.prefetch_loads

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 1.0

    @property
    def loads_per_token(self) -> float:
        return self.loads / self.tokens if self.tokens else 0.0

    @property
    def bytes_per_token(self) -> float | None:
        return None if self.expert_bytes is None else self.loads_per_token * self.expert_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"total_slots": sum(self.slots_per_layer), "loads": self.loads,
                               "hit_rate": self.hit_rate, "loads_per_token": self.loads_per_token,
                               "bytes_per_token": self.bytes_per_token}


def trace_curves(trace: Trace) -> np.ndarray:
    """The planner's miss curves for this trace (what the engine would have measured live)."""
    recorder = MissCurveRecorder(trace.num_layers, trace.num_experts)
    for step in trace.steps:
        recorder.record(RoutingStep.of_layer(step.layer, step.experts, tokens=step.tokens))
    return recorder.curves()


def resolve_slots(trace: Trace, spec: BudgetSpec, expert_bytes: int | None) -> int:
    """A budget as a total slot count for this trace's geometry (not yet clamped)."""
    everything = trace.num_layers * trace.num_experts
    if spec.slots is not None:
        return spec.slots
    if spec.everything:
        return everything
    if spec.fraction is not None:
        return int(everything * spec.fraction)
    if not expert_bytes:
        raise ValueError("a budget in bytes needs the size of one expert: pass --expert-bytes (or use 25% / 64slots)")
    return int(spec.nbytes or 0) // expert_bytes


def plan_slots(trace: Trace, total_slots: int, allocation: str) -> tuple[list[int], str]:
    curves = trace_curves(trace) if allocation == "planned" else None
    return allocate(total_slots, trace.num_layers, trace.num_experts, trace.top_k, curves, allocation)


def replay(trace: Trace, policy: CachePolicy, slots_per_layer: list[int], *, expert_bytes: int | None = None,
           warm: bool = True, profile: np.ndarray | None = None) -> ReplayResult:
    """`profile`: calibration counts for `needs_profile` policies (default: built from the trace itself)."""
    L, E = trace.num_layers, trace.num_experts
    policy.reset(L, E, trace.top_k)
    if policy.needs_profile:
        policy.set_profile(profile if profile is not None else trace.activation_counts())
    directory = CacheDirectory(slots_per_layer, policy)
    if warm:  # as the engine does at load: fill every slot, the policy's favourites first
        for layer, count in enumerate(slots_per_layer):
            order = list(policy.preferred(layer) or range(E))
            listed = set(order)
            order += [e for e in range(E) if e not in listed]
            for expert in order[:count]:
                directory.assign(layer, expert, ())
    result = ReplayResult(policy.name, list(slots_per_layer), trace.tokens, expert_bytes=expert_bytes)
    lossy = policy.restricts_routing
    started = False
    for new_step, new_request, step in steps_by_boundary(trace):
        if new_step and started:
            policy.on_token_end()
        if new_request:
            policy.on_request_start()
        started = True
        layer, experts, counts = step.layer, step.experts, step.counts
        if lossy:  # the router may only pick residents: replaced choices are counted, not loaded
            scores = np.zeros(E)
            scores[experts] = step.mass
            policy.on_router_scores(layer, scores)
            resident = directory.slot_of[layer]
            keep = [i for i, e in enumerate(experts) if e in resident]
            result.rerouted += len(experts) - len(keep)
            result.accesses += len(experts) - len(keep)
            experts, counts = [experts[i] for i in keep], [counts[i] for i in keep]
        found = directory.lookup(RoutingStep.of_layer(layer, experts, counts, step.tokens))[0]
        result.accesses += len(experts)
        result.hits += len(found.ready)
        result.misses += len(found.missing)
        result.prefetch_hits += len(found.prefetch_hits)
        if policy.lookahead:
            window = {t: p for t, p in step.predictions.items() if t - layer <= policy.lookahead}
            policy.on_prediction(layer, window)
        protected = set(experts)
        capacity = slots_per_layer[layer]
        room = capacity - len(found.ready)
        first, rest = found.missing[:room], found.missing[room:]
        for expert in first:
            directory.assign(layer, expert, protected)
        wanted = [(lyr, e) for lyr, e in policy.prefetch(layer) if lyr != layer]
        for lyr, expert, _ in directory.place_prefetches(wanted, {layer: protected}):
            directory.complete(lyr, expert)  # no time model: the prefetch arrives in time
            result.prefetch_loads += 1
        while rest:
            wave, rest = rest[:capacity], rest[capacity:]
            for expert in wave:
                directory.assign(layer, expert, set(wave))
    if started:
        policy.on_token_end()
    result.extra = policy.stats()
    return result


def belady_for(trace: Trace) -> BeladyPolicy:
    future: list[list[list[int]]] = [[] for _ in range(trace.num_layers)]
    for step in trace.steps:
        future[step.layer].append(step.experts)
    return BeladyPolicy(future)


@dataclass
class Comparison:
    budget: str
    allocation: str
    policy: ReplayResult
    belady: ReplayResult
    predicted_hit_rate: float | None = None  # the planner's estimate from the trace's miss curves

    def as_dict(self) -> dict:
        return self.policy.as_dict() | {"budget": self.budget, "allocation": self.allocation,
                                        "predicted_hit_rate": self.predicted_hit_rate,
                                        "belady": self.belady.as_dict()}


def compare(trace: Trace, policy_spec: str, spec: BudgetSpec, *, allocation: str = "planned",
            expert_bytes: int | None = None, profile: np.ndarray | None = None) -> Comparison:
    """Replay `policy_spec` and Belady's MIN with the same slots; the CLI's `trace replay`."""
    expert_bytes = expert_bytes or trace.expert_bytes
    total = resolve_slots(trace, spec, expert_bytes)
    slots, used = plan_slots(trace, total, allocation)
    online = replay(trace, make_policy(policy_spec), slots, expert_bytes=expert_bytes, profile=profile)
    offline = replay(trace, belady_for(trace), slots, expert_bytes=expert_bytes)
    curves = trace_curves(trace)
    return Comparison(str(spec), used, online, offline, predict(curves, slots).hit_rate)
