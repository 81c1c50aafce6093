"""The budget planner: miss curves from stack distances, planned vs uniform allocation, predictions."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from engine.accounting.miss_curves import MissCurveRecorder
from engine.accounting.planner import Geometry, estimate, plan_budget, planned_allocation, predict, uniform_allocation
from engine.accounting.policies import make_policy
from engine.accounting.routing import RoutingStep
from engine.traces.replay import plan_slots, replay, trace_curves
from tests.helpers.traces import skewed_trace


def test_planner_imports_without_torch():
    # The GUI calls the planner while the slider is dragged; it must not pull torch in.
    code = ("import sys; import engine.accounting.planner, engine.accounting.miss_curves, engine.traces.replay, engine.traces.trace; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stack_distance_curve_by_hand():
    # one layer, top-1: 0 1 2 0 1 2 ... after warm-up order 0,1,2,3 (0 most recent)
    rec = MissCurveRecorder(1, 4)
    for e in [0, 1, 2] * 3:
        rec.record(RoutingStep.of_layer(0, [e]))
    curve = rec.curves()[0] * 9  # misses in total, per slot count
    # 1 slot: only the first access (0, on top of the warm stack) hits; 2 slots: the first two;
    # 3 slots hold the whole cycle
    assert curve.tolist() == [9, 8, 7, 0, 0]


def test_a_whole_tokens_routing_recorded_at_once_equals_layer_by_layer():
    # The whole-token path records a token's routing as one step of every layer; the curves,
    # stacks and counts must be those of the per-layer path, from any warm-up order.
    rng = np.random.default_rng(7)
    layers, experts, top_k = 5, 16, 4
    warm = [rng.permutation(experts)[:10].tolist() for _ in range(layers)]
    by_layer, at_once = MissCurveRecorder(layers, experts, warm), MissCurveRecorder(layers, experts, warm)
    for _ in range(200):
        picks = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
        for layer in range(layers):
            by_layer.record(RoutingStep.of_layer(layer, sorted(picks[layer].tolist())))
        at_once.record(RoutingStep.of_token(picks))
    assert np.array_equal(by_layer.hist, at_once.hist)
    assert by_layer.stacks == at_once.stacks
    assert np.array_equal(by_layer.tokens, at_once.tokens) and by_layer.steps == at_once.steps == 200
    assert np.array_equal(by_layer.curves(), at_once.curves())


def test_curves_match_lru_replay_for_every_slot_count():
    trace = skewed_trace(num_layers=4, num_experts=16, top_k=1, tokens=400, requests=1, seed=3)
    curves = trace_curves(trace)
    for s in range(1, 17):
        replayed = replay(trace, make_policy("lru"), [s] * 4)
        predicted = predict(curves, [s] * 4)
        # warm-up orders differ (the stack puts expert 0 on top, the cache fills 0 first): a few accesses apart
        assert abs(predicted.misses_per_token * trace.tokens - replayed.misses) <= 4 * s


def test_planner_beats_uniform_on_skewed_working_sets():
    trace = skewed_trace()
    curves = trace_curves(trace)
    for total in (24, 40, 64, 100):
        planned = planned_allocation(curves, total, trace.top_k)
        uniform = uniform_allocation(total, trace.num_layers, trace.top_k, trace.num_experts)
        assert sum(planned) == sum(uniform) == total
        assert min(planned) >= trace.top_k and max(planned) <= trace.num_experts
        assert predict(curves, planned).misses_per_token < predict(curves, uniform).misses_per_token
    # the narrow first layer gets far fewer slots than the wide last one
    planned = planned_allocation(curves, 64, trace.top_k)
    assert planned[0] < planned[-1]


@pytest.mark.parametrize("total", [24, 40, 64, 100, 160])
def test_predicted_hit_rate_within_5_points_of_replay(total, capsys):
    trace = skewed_trace()
    slots, used = plan_slots(trace, total, "planned")
    assert used == "planned"
    predicted = predict(trace_curves(trace), slots).hit_rate
    replayed = replay(trace, make_policy("lru"), slots).hit_rate
    with capsys.disabled():
        print(f"\n[planner] {total} slots {slots}: predicted hit rate {predicted:.1%}, replayed LRU {replayed:.1%}")
    assert abs(predicted - replayed) < 0.05


def test_planned_replay_beats_uniform_replay():
    trace = skewed_trace()
    for total in (40, 64, 100):
        planned = replay(trace, make_policy("lru"), plan_slots(trace, total, "planned")[0])
        uniform = replay(trace, make_policy("lru"), plan_slots(trace, total, "uniform")[0])
        assert planned.misses < uniform.misses


def test_plan_budget_clamps_and_predicts():
    g = Geometry(num_layers=8, num_experts=32, top_k=2, slot_bytes=1000)
    curves = trace_curves(skewed_trace())
    low = plan_budget(g, 1, curves=curves)
    assert low.slots_per_layer == [2] * 8 and "below this model's minimum" in low.note
    plan = plan_budget(g, 50_000, curves=curves)
    assert plan.allocation == "planned" and sum(plan.slots_per_layer) == 50
    assert plan.prediction is not None and 0 < plan.prediction.hit_rate < 1
    assert plan.prediction.bytes_per_token == pytest.approx(plan.prediction.misses_per_token * 1000)
    blind = plan_budget(g, 50_000)  # no routing seen yet: uniform
    assert blind.allocation == "uniform" and blind.prediction is None
    slots, pred = estimate(curves, 50_000, 1000, 2)
    assert slots == plan.slots_per_layer and pred == plan.prediction


def test_non_convex_curve_gets_its_cliff():
    # layer 0 gains nothing until it has 6 slots, then everything; layer 1 gains a little per slot
    curves = np.zeros((2, 9), dtype=np.float32)
    curves[0, :6] = 4.0
    curves[1] = np.linspace(2.0, 0.0, 9)
    slots = planned_allocation(curves, 2 + 6, 1)
    assert slots == [6, 2]  # a plain one-slot-at-a-time greedy would never climb layer 0's flat stretch


def test_replanning_64_layers_by_256_experts_is_fast(capsys):
    rng = np.random.default_rng(0)
    rec = MissCurveRecorder(64, 256)
    for _ in range(100):
        for layer in range(64):
            width = 16 + 3 * layer
            rec.record(RoutingStep.of_layer(layer, np.unique(rng.zipf(1.2, size=16) % width)[:8]))
    curves = rec.curves()
    times = []
    for total in (64 * 8, 64 * 40, 64 * 128, 64 * 200):
        start = time.perf_counter()
        slots = planned_allocation(curves, total, 8)
        times.append(time.perf_counter() - start)
        assert sum(slots) == total
    with capsys.disabled():
        print(f"\n[planner] re-plan 64 layers x 256 experts: {max(times) * 1e3:.1f} ms (worst of 4 budgets); "
              "O(layers*experts*log) by construction (hull per layer + one sort)")


def test_runtime_measures_miss_curves_and_replans_from_them_exactly(mixtral_checkpoint):
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings
    from tests.helpers.checkpoints import reference_generate

    prompt = [1, 23, 45, 67, 8, 9, 10]
    expected = reference_generate(mixtral_checkpoint, prompt, 16)
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="all", store="disk"))
    assert runtime.miss_curves() is None  # nothing routed yet
    plans = []
    tokens: list[int] = []

    def between_tokens() -> bool:
        if len(tokens) in (4, 10):
            plans.append(runtime.set_budget("40%" if len(tokens) == 4 else "1"))
        return False

    result = Generator(runtime).generate(prompt, SamplingSettings(temperature=0, max_new_tokens=16), on_token=tokens.append,
                                         between_tokens=between_tokens)
    curves = runtime.miss_curves()
    runtime.close()
    assert result.token_ids == expected
    layers, experts = runtime.layout.num_layers, runtime.layout.num_experts
    assert curves.shape == (layers, experts + 1) and curves.dtype == np.float32
    assert (np.diff(curves, axis=1) <= 1e-6).all() and (curves[:, -1] == 0).all()  # more slots, fewer misses
    assert curves[:, 0].sum() > 0
    planned = plans[0]
    assert planned.allocation == "planned" and planned.prediction is not None
    assert sum(planned.slots_per_layer) == int(0.4 * layers * experts)
    assert plans[1].slots_per_layer == [runtime.layout.top_k] * layers
