"""Retraining the demo model with the card's seed reproduces its figures (issue 6).

Slow (about 16 minutes on 2 idle cores, twice that on a shared machine): `pytest -m slow
tests/test_demo_reproducible.py`. Training is deterministic on CPU for a given seed and thread
count, so the retrained weights are expected to be byte-identical; the card's requirement is
weaker — held-out accuracy within 2 points for every skill — and that is what is asserted.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from engine.decode.runtime import MoERuntime
from engine.demo.corpus import SKILLS, heldout
from engine.demo.engine_backend import engine_answer_fn
from engine.demo.evaluate import accuracy_per_skill
from engine.demo.train import TrainConfig, train
from engine.protocol import LoadModel
from resources import DEMO_MODEL_DIR

CARD = json.loads((DEMO_MODEL_DIR / "moescope_demo.json").read_text())


@pytest.mark.slow
def test_retraining_with_the_cards_seed_reproduces_its_accuracy(tmp_path, capsys):
    out = tmp_path / "demo"
    train(TrainConfig(seed=CARD["seed"], steps=CARD["steps"]), out, max_minutes=60)
    runtime = MoERuntime(LoadModel(path=str(out), budget="25%", store="disk"))
    try:
        n = CARD["heldout_per_skill"]
        report = accuracy_per_skill(engine_answer_fn(runtime), {s: heldout(s, n) for s in SKILLS})
    finally:
        runtime.close()
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    with capsys.disabled():
        print(f"\n[retrained demo] byte-identical: {digest == CARD['model_sha256']}; "
              + ", ".join(f"{s} {r['accuracy']:.0%} (card {CARD['accuracy'][s]:.0%})" for s, r in report.items()))
    for skill, result in report.items():
        assert abs(result["accuracy"] - CARD["accuracy"][skill]) <= 0.02, skill
