"""The weight format picker in the window, against a real engine worker: a choice reaches the engine,
the model reloads in it (converted with progress), the panels count its bytes, and it is remembered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.main_window import MainWindow
from app.model_bar import ModelBar
from app.models.format_choices import card_quality, choice_label, loaded_formats_text
from app.models.history import HistoryStore
from app.models.stats_format import format_bytes
from app.settings import AppSettings
from engine import protocol as p
from tests.helpers.app_fixtures import Recorder, model_loaded
from tests.helpers.checkpoints import WIDE, save_tiny_checkpoint

LOAD_MS = 120_000  # spawning the worker imports torch + transformers: slow on a busy 2-core machine


def open_window(qtbot, settings: Path, model: Path, tmp_path: Path) -> tuple[MainWindow, Recorder]:
    window = MainWindow(settings=AppSettings(str(settings)), store=HistoryStore(tmp_path / "h.sqlite3"))
    qtbot.addWidget(window)
    recorder = Recorder(window)
    window.show()
    window.start_engine(str(model))
    qtbot.waitUntil(lambda: window.chat.ready or window.banner.isVisible(), timeout=LOAD_MS)
    assert window.chat.ready, window.banner.label.text()
    return window, recorder


def loaded(events: Recorder) -> list[p.ModelLoaded]:
    return events.of(p.ModelLoaded)


def test_a_quality_figure_on_the_model_card_labels_its_format_and_the_rest_say_approximate(qtbot, tmp_path):
    def row(experts: str, dense: str = "original", **figures) -> dict:
        return {"expert_format": experts, "dense_format": dense, **figures}

    (tmp_path / "moescope_demo.json").write_text(json.dumps({"format_quality": {"rows": [
        row("original", claimed_mean_delta_points=0.0, kl_mean=0.0),
        row("q4_k", claimed_mean_delta_points=-1.25, kl_mean=0.0042), row("q8_0", claimed_mean_delta_points=0.0),
        row("q4_k", "q8_0", claimed_mean_delta_points=-9.0), row("q2_k", kl_mean="n/a")]}}))
    quality = card_quality(str(tmp_path))
    assert set(quality) == {"q4_k", "q8_0"}  # a figure that is not a number is no figure; mixed rows aside
    bar = ModelBar()
    qtbot.addWidget(bar)
    loaded = model_loaded()
    loaded.path, loaded.expert_format = str(tmp_path), "q4_k"
    bar.on_event(loaded)
    picker = bar.expert_format
    labels = [picker.itemText(i) for i in range(picker.count())]
    assert labels == ["Original", "8-bit (Q8_0), approximate: +0.0 accuracy points", "6-bit (Q6_K), approximate",
                      "4-bit (Q4_K), approximate: -1.2 accuracy points, KL 0.0042", "3-bit (Q3_K), approximate",
                      "2-bit (Q2_K), approximate"]
    assert picker.current() == "q4_k" and picker.isEnabled()
    assert "No measured quality figure" in picker.itemData(picker.findData("q3_k"), 3)  # Qt.ToolTipRole
    assert card_quality(str(tmp_path / "elsewhere")) == {}  # no card: labels say approximate only
    demo = card_quality("demo")  # the embedded model's card carries the measured figures
    assert {"q8_0", "q4_k", "q2_k"} <= set(demo) and demo["q8_0"].accuracy_delta_points == 0.0
    assert loaded_formats_text("4bit", "original", "bfloat16") == "experts Q4_K, dense bf16"


@pytest.mark.process
def test_picking_4_bit_reloads_in_q4_k_and_the_panels_count_its_bytes(qtbot, tmp_path):
    model = save_tiny_checkpoint("mixtral", tmp_path / "mixtral", **WIDE["mixtral"])  # whole 256-wide Q4_K blocks
    window, events = open_window(qtbot, tmp_path / "settings.ini", model, tmp_path)
    try:
        original = loaded(events)[-1]
        assert original.expert_format == "original" and window.model_bar.expert_format.current() == "original"
        assert window.system.formats.text() == "experts fp32, dense fp32"

        picker = window.model_bar.expert_format
        index = picker.findData("q4_k")
        assert picker.itemText(index) == choice_label("q4_k") == "4-bit (Q4_K), approximate"  # no card: no figure
        picker.setCurrentIndex(index)
        picker.activated.emit(index)  # as a user's pick does
        qtbot.waitUntil(lambda: len(loaded(events)) == 2 or window.banner.isVisible(), timeout=LOAD_MS)
        assert not window.banner.isVisible(), window.banner.label.text()
        q4 = loaded(events)[-1]

        assert q4.expert_format == "q4_k" and q4.dense_format == "original"
        assert any("converting experts to 4-bit (Q4_K)" in e.message for e in events.of(p.LoadProgress))
        # 4.5 bits a weight instead of 32: the same experts in about a seventh of the bytes
        assert q4.all_expert_bytes < original.all_expert_bytes / 5
        assert window.budget.max_label.text() == f"everything {format_bytes(q4.max_budget_bytes)}"
        assert format_bytes(q4.max_budget_bytes) != format_bytes(original.max_budget_bytes)
        assert window.system.formats.text() == "experts Q4_K, dense fp32"
        assert "Q4_K" in window.model_bar.details.text()
        assert window.settings.formats_for(str(model)) == ("q4_k", "original")
    finally:
        window.close()

    # a new window loads the model in the remembered format
    again, events = open_window(qtbot, tmp_path / "settings.ini", model, tmp_path)
    try:
        assert loaded(events)[-1].expert_format == "q4_k"
        assert again.model_bar.expert_format.current() == "q4_k"
    finally:
        again.close()

