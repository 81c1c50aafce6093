"""The embedded demo model through the engine: it answers, its experts specialise, offloading is exact."""

from __future__ import annotations

import json

import pytest

from engine.decode.runtime import MoERuntime
from engine.demo.corpus import SKILLS, heldout
from engine.demo.engine_backend import engine_answer_fn, engine_expert_usage
from engine.demo.evaluate import accuracy_per_skill, specialisation
from engine.protocol import LoadModel
from resources import DEMO_MODEL_DIR

CARD = json.loads((DEMO_MODEL_DIR / "moescope_demo.json").read_text())
# The first 20 of the held-out questions the card's figures come from (it scores 50 a skill): 400
# replies took most of a minute, and test_answers_at_25_percent_equal_answers_at_all holds the
# small budget to the whole model's answers.
N_PER_SKILL = 20


@pytest.fixture(scope="module")
def small_budget_runtime():
    runtime = MoERuntime(LoadModel(path="demo", budget="25%", store="disk"))
    yield runtime
    runtime.close()


def test_demo_model_ships_within_size():
    size = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.is_file())
    assert size <= 30 * 2**20
    assert (DEMO_MODEL_DIR / "README.md").is_file()


def test_every_claimed_skill_is_answered_correctly_at_a_small_budget(small_budget_runtime, capsys):
    assert set(CARD["skills"]) <= set(SKILLS)
    examples = {skill: heldout(skill, N_PER_SKILL) for skill in CARD["skills"]}
    report = accuracy_per_skill(engine_answer_fn(small_budget_runtime), examples)
    with capsys.disabled():
        print("\n[demo accuracy, engine at 25%] " + ", ".join(f"{s} {r['accuracy']:.0%}" for s, r in report.items()))
    for skill, result in report.items():
        assert result["accuracy"] >= 0.9, (skill, result["wrong"][:3])


def test_experts_specialise_by_skill(small_budget_runtime, capsys):
    usage = {skill: engine_expert_usage(small_budget_runtime, [e.user for e in heldout(skill, 20)]) for skill in SKILLS}
    report = specialisation(usage)
    with capsys.disabled():
        print(f"\n[demo specialisation] mean layer-averaged JS divergence {report['mean']:.3f} bits; "
              f"closest pair {report['min_pair'][0]} {report['min_pair'][1]:.3f}")
    assert report["mean"] > 0.1


def test_answers_at_25_percent_equal_answers_at_all(small_budget_runtime):
    users = [e.user for skill in SKILLS for e in heldout(skill, 4)]
    full = MoERuntime(LoadModel(path="demo", budget="all", store="ram"))
    try:
        assert engine_answer_fn(small_budget_runtime)(users) == engine_answer_fn(full)(users)
    finally:
        full.close()
    assert small_budget_runtime.counters.layer_misses.sum() > 0  # the small budget really offloaded


def test_four_bit_experts_of_the_float32_demo_expand_natively_into_the_references_values():
    """The demo computes in float32, where the native kernels' decode paths do not run: its quantized
    experts are expanded for transformers' kernels every time they are used, by the native
    dequantizer where it is loaded (the torch reference's dozen small ops a matrix made 4-bit decode
    slower than the original format). Both expansions give the same replies, and the System panel's
    reason names the float32 model, not the prompt path."""
    from engine.decode.native import kernels as native
    from engine.formats.dequantize import reference_dequantizer

    runtime = MoERuntime(LoadModel(path="demo", budget="all", expert_format="q4_k"))
    try:
        users = [e.user for skill in CARD["skills"] for e in heldout(skill, 1)]
        fast = engine_answer_fn(runtime)(users)
        assert "float32" in runtime.decode_path_reason
        if native.ready() is not None:
            runtime.cache.use_dequantizer(reference_dequantizer)
            assert engine_answer_fn(runtime)(users) == fast
    finally:
        runtime.close()
