"""Trace replay: run a recorded routing trace through a policy and the engine's own CacheDirectory.

Per step and layer it calls the directory and the policy in the engine's order (lookup ->
predictions -> exact loads -> prefetches -> waves), so the hit rate it reports is the one the
engine would see. What it does not model is time: a prefetch is assumed to arrive before it is
needed (the engine measures lateness live: `prefetch_late`). Loads at warm-up are not counted, as
in the engine.

Scoring is honest by construction (`compare`): the first part of the trace (`CALIBRATION`, a
quarter by default: whole requests, or the first forward steps of a one-request trace) calibrates
and is never scored. Every policy replays it first as its warm-up, as the engine would have served
those requests; a policy that needs a calibration profile gets one built from it (or from another
trace, `profile=`, refused when that trace holds the scored routing); the planner's miss curves
come from it. Only the rest is scored, the same tokens for every policy. A profile built from
the scored routing itself (knowing the future's expert frequencies) is only used when asked for
(`oracle=True`), and the result is labelled "(oracle)".

Next to every online policy it runs Belady's MIN (offline optimal eviction, `BeladyPolicy`) on the
scored part with the same slots, starting from the best possible cache (the experts needed
soonest), its prompts' waves streamed in its own order too (`CacheDirectory.wave_order`): no
demand-loading policy, from any state, can load fewer experts there. A prefetching
policy can show a higher hit rate than MIN (its prefetches are not misses), but never fewer loads.
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
from engine.traces.trace import Trace, TraceStep, steps_by_boundary

CALIBRATION = 0.25  # share of a trace that calibrates by default (the CLI's --calibrate)


class ReplayError(ValueError):
    """A replay that would not mean what it says; the message says what to give instead."""


@dataclass
class ReplayResult:
    policy: str  # the policy as asked for (name and options), with " (oracle)" when calibrated on the scored routing
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


    def ratios(self, belady: ReplayResult) -> tuple[float, float]:
        """(hit rate / Belady's, loads / Belady's) on the same scored tokens."""
        hits = self.hit_rate / belady.hit_rate if belady.hit_rate else 1.0
        loads = self.loads / belady.loads if belady.loads else (1.0 if not self.loads else float("inf"))
        return hits, loads


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


def plan_slots(calibration: Trace, total_slots: int, allocation: str) -> tuple[list[int], str]:
    """Slots per layer from the calibration part's miss curves (uniform when it is empty)."""
    curves = trace_curves(calibration) if allocation == "planned" and calibration.steps else None
    return allocate(total_slots, calibration.num_layers, calibration.num_experts, calibration.top_k, curves, allocation)


def replay(trace: Trace, policy: CachePolicy, slots_per_layer: list[int], *, history: Trace | None = None,
           expert_bytes: int | None = None, warm: bool = True, profile: np.ndarray | None = None,
           ranked_waves: bool = True) -> ReplayResult:
    """Replay `history` unscored (the policy's warm-up, as earlier requests in the engine), then score `trace`.

    `profile`: calibration counts, required by `needs_profile` policies; never built here, so a
    profile of the scored routing is always the caller's explicit choice (see `compare`).
    `ranked_waves`: a step that needs more experts than the layer has slots streams them in the
    policy's order and holds the resident ones it wants most (`CacheDirectory.wave_order`), as the
    engine does; False streams them in id order, as the engine did before (a study)."""
    policy.reset(trace.num_layers, trace.num_experts, trace.top_k)
    if policy.needs_profile:
        if profile is None:
            raise ReplayError(f"policy '{policy.name}' needs a calibration profile; give one built from other routing")
        policy.set_profile(profile)
    directory = CacheDirectory(slots_per_layer, policy)
    if warm:
        _fill_slots(directory, policy, slots_per_layer, trace.num_experts)
    result = ReplayResult(policy.name, list(slots_per_layer), trace.tokens, expert_bytes=expert_bytes)
    started = False
    unscored = len(history.steps) if history is not None else 0
    everything = trace if history is None else Trace(trace.num_layers, trace.num_experts, trace.top_k,
                                                     history.steps + trace.steps)
    for index, (new_step, new_request, step) in enumerate(steps_by_boundary(everything)):
        if index == unscored:  # the scored part starts: count from here
            result = ReplayResult(policy.name, list(slots_per_layer), trace.tokens, expert_bytes=expert_bytes)
        if new_step and started:
            policy.on_token_end()
        if new_request:
            policy.on_request_start()
        started = True
        _replay_step(step, directory, policy, result, slots_per_layer[step.layer], trace.num_experts, ranked_waves)
    if started:
        policy.on_token_end()
    result.extra = policy.stats()
    return result


def _fill_slots(directory: CacheDirectory, policy: CachePolicy, slots_per_layer: list[int], num_experts: int) -> None:
    """As the engine does at load: fill every slot, the policy's favourites first."""
    for layer, count in enumerate(slots_per_layer):
        order = list(policy.preferred(layer) or range(num_experts))
        listed = set(order)
        order += [e for e in range(num_experts) if e not in listed]
        for expert in order[:count]:
            directory.assign(layer, expert, ())


def _resident_choices(step: TraceStep, directory: CacheDirectory, policy: CachePolicy, num_experts: int,
                      result: ReplayResult) -> tuple[list[int], list[int]]:
    """A lossy policy's router may only pick residents: the step's experts and counts it keeps;
    the replaced choices are counted, not loaded."""
    scores = np.zeros(num_experts)
    scores[step.experts] = step.mass
    policy.on_router_scores(step.layer, scores)
    resident = directory.slot_of[step.layer]
    keep = [i for i, e in enumerate(step.experts) if e in resident]
    result.rerouted += len(step.experts) - len(keep)
    result.accesses += len(step.experts) - len(keep)
    return [step.experts[i] for i in keep], [step.counts[i] for i in keep]


def _replay_step(step: TraceStep, directory: CacheDirectory, policy: CachePolicy, result: ReplayResult, capacity: int,
                 num_experts: int, ranked_waves: bool) -> None:
    """One layer's routing: look it up, count it, load the misses (in waves through the slots when
    they outnumber the free ones) and place the policy's prefetches for other layers."""
    layer, experts, counts = step.layer, step.experts, step.counts
    if policy.restricts_routing:
        experts, counts = _resident_choices(step, directory, policy, num_experts, result)
    found = directory.lookup(RoutingStep.of_layer(layer, experts, counts, step.tokens, step.last))[0]
    result.accesses += len(experts)
    result.hits += len(found.ready)
    result.misses += len(found.missing)
    result.prefetch_hits += len(found.prefetch_hits)
    if policy.lookahead:
        window = {t: p for t, p in step.predictions.items() if t - layer <= policy.lookahead}
        policy.on_prediction(layer, window)
    protected = set(experts)
    room = capacity - len(found.ready)
    missing, held = found.missing, set()
    if ranked_waves and len(missing) > room:
        missing, held = directory.wave_order(layer, experts, missing)
    first, rest = missing[:room], missing[room:]
    for expert in first:
        directory.assign(layer, expert, protected)
    wanted = [(lyr, e) for lyr, e in policy.prefetch(layer) if lyr != layer]
    for lyr, expert, _ in directory.place_prefetches(wanted, {layer: protected}):
        directory.complete(lyr, expert)  # no time model: the prefetch arrives in time
        result.prefetch_loads += 1
    size = capacity - len(held)
    while rest:
        wave, rest = rest[:size], rest[size:]
        for expert in wave:
            directory.assign(layer, expert, set(wave) | held)


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
    predicted_hit_rate: float | None = None  # the planner's estimate from the calibration part's miss curves
    calibration: str = ""  # what calibrated, e.g. "the first 8 of 32 requests"
    oracle: bool = False  # the policy's profile was built from the scored routing

    def as_dict(self) -> dict:
        hits, loads = self.policy.ratios(self.belady)
        return self.policy.as_dict() | {"budget": self.budget, "allocation": self.allocation,
                                        "predicted_hit_rate": self.predicted_hit_rate, "calibration": self.calibration,
                                        "oracle": self.oracle, "hit_rate_vs_belady": hits, "loads_vs_belady": loads,
                                        "belady": self.belady.as_dict()}


def contains(source: Trace, scored: Trace) -> bool:
    """Does `source` hold any scored request's routing, in order (the same request replayed or recorded
    twice)? A profile built from it would know the scored future."""
    def lines(trace: Trace) -> dict[int, str]:
        out: dict[int, list[str]] = {}
        for s in trace.steps:
            out.setdefault(s.request, []).append(f"{s.layer}:{','.join(map(str, s.experts))};")
        return {r: "".join(v) for r, v in out.items()}

    known = list(lines(source).values())
    return any(any(text in other for other in known) for text in lines(scored).values())


def describe_split(trace: Trace, calibration: Trace) -> str:
    """What calibrated, for every table: 'the first 8 of 32 requests' / 'the first 75 of 299 tokens'."""
    if trace.requests > 1:
        return f"the first {calibration.requests} of {trace.requests} requests"
    return f"the first {calibration.tokens} of {trace.tokens} tokens"


def compare(trace: Trace, policy_spec: str, spec: BudgetSpec, *, calibrate: float = CALIBRATION,
            allocation: str = "planned", expert_bytes: int | None = None, profile: Trace | None = None,
            oracle: bool = False) -> Comparison:
    """Replay `policy_spec` and Belady's MIN with the same slots on the part of `trace` after the first
    `calibrate` share, which calibrates (see the module's docstring); the CLI's `trace replay`.

    `profile`: another trace to build a profile-needing policy's profile from (instead of the
    calibration part); refused when it holds the scored routing. `oracle`: build that profile from
    the scored routing itself, labelled "(oracle)"."""
    expert_bytes = expert_bytes or trace.expert_bytes
    calibration, scored = trace.split(calibrate)
    if not scored.steps:
        raise ReplayError("nothing is left to score after the calibration part: give a smaller --calibrate")
    policy = make_policy(policy_spec)
    counts = None
    if policy.needs_profile:
        counts = _profile(policy.name, calibration, scored, profile, oracle)
    total = resolve_slots(trace, spec, expert_bytes)
    slots, used = plan_slots(calibration, total, allocation)
    online = replay(scored, policy, slots, history=calibration, expert_bytes=expert_bytes, profile=counts)
    labelled = oracle and policy.needs_profile
    online.policy = policy_spec.strip() + (" (oracle)" if labelled else "")  # the options too: markov:decay=0.9
    offline = replay(scored, belady_for(scored), slots, expert_bytes=expert_bytes)
    predicted = predict(trace_curves(calibration), slots).hit_rate if calibration.steps else None
    return Comparison(str(spec), used, online, offline, predicted, describe_split(trace, calibration), labelled)


def _profile(name: str, calibration: Trace, scored: Trace, profile: Trace | None, oracle: bool) -> np.ndarray:
    if oracle:
        return scored.activation_counts()  # the answer key, asked for and labelled
    if profile is not None:
        if contains(profile, scored):
            raise ReplayError(f"the profile trace holds the routing being scored, so '{name}' would know the future: "
                              "give a profile from other requests, or --oracle to score it that way, labelled (oracle)")
        return profile.activation_counts()
    if not calibration.steps:
        raise ReplayError(f"'{name}' needs a calibration profile and nothing calibrates: give --calibrate above 0 %, "
                          "--profile FILE (other requests), or --oracle to build it from the scored routing (labelled)")
    return calibration.activation_counts()
