"""The window on a laptop screen (issue 59): it opens within the screen, its minimum fits 1024 x 640,
the panels take one column of tabs on a narrow screen and two columns on a wide one, no label cuts
its text off without a tooltip, a reload moves nothing, and a format change keeps the budget's share.

The fast tests run offscreen with the screen's available area given to the window; the others open
the real window on Qt's xcb platform under Xvfb, at the screen sizes people use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QRect, QSize
from PySide6.QtWidgets import QApplication

from app.elided_label import ElidedLabel
from app.engine_bridge import EngineBridge
from app.layout_facts import clipped_labels, layout_signature, window_facts
from app.main_window import MainWindow
from app.models.budget import same_share
from app.models.history import HistoryStore
from app.settings import AppSettings
from app.window_layout import fits, fitted_geometry, saved_frame_size
from engine import protocol as p
from tests.helpers.app_fixtures import ScriptedClient, model_loaded, snapshot
from tests.helpers.window_report import assert_heatmap_drawn, screenshot_report
from tests.helpers.xvfb import xvfb_display

ROOT = Path(__file__).resolve().parents[1]
LAPTOP = QRect(0, 0, 1366, 728)  # 1366 x 768 less a 40 px taskbar
DESKTOP = QRect(0, 0, 1920, 1040)
MOST = QSize(1024, 640)  # the window's minimum must fit this
SPELL = "Spell 'elephant'."  # the demo model was trained on these phrasings
QT_ENV = ("QT_QPA_PLATFORM", "QT_PLUGIN_PATH", "QT_QPA_PLATFORM_PLUGIN_PATH", "DISPLAY", "WAYLAND_DISPLAY",
          "XDG_SESSION_TYPE", "QT_DEBUG_PLUGINS", "QT_SCALE_FACTOR")


def open_window(qtbot, monkeypatch, tmp_path: Path, available: QRect) -> MainWindow:
    """A window with a scripted engine, on a screen whose available area is `available`."""
    monkeypatch.setattr(MainWindow, "available_geometry", lambda _self: QRect(available))
    bridge = EngineBridge(client_factory=ScriptedClient)
    window = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")),
                        store=HistoryStore(tmp_path / "history.sqlite3"), bridge=bridge)
    qtbot.addWidget(window)
    window.frame.stop()  # the test draws (settle): a check must not catch a frame half laid out
    window.show()
    qtbot.waitExposed(window)
    return window


def load(qtbot, window: MainWindow, event: p.ModelLoaded | None = None) -> p.ModelLoaded:
    """A model loaded (the demo's path: its card gives the format pickers their long labels) and drawn."""
    event = event or model_loaded(layers=24, experts=64, budget_slots=32)
    event.path = "demo"
    window.start_engine("demo")
    window.bridge.client.emit(event)
    window.bridge.client.emit(snapshot(layers=event.num_layers, experts=event.num_experts,
                                       slots=event.slots_per_layer[0]))
    qtbot.waitUntil(lambda: window.chat.ready)
    settle(qtbot, window)
    return event


def settle(qtbot, window: MainWindow) -> None:
    """Every panel drawn and every pending layout applied."""
    for panel in window.panels:
        panel.dirty = True
    window.refresh()
    qtbot.waitUntil(lambda: not any(panel.dirty for panel in window.panels if panel.isVisible()))
    for _ in range(3):  # the layout requests the new text posted, and those their resizing posted
        QApplication.processEvents()


def shown(window: MainWindow) -> set[str]:
    return {name for name, dock in window_facts(window)["docks"].items() if dock["shown"]}


# ----------------------------------------------------------------- offscreen


def test_the_minimum_fits_a_small_laptop_in_either_arrangement(qtbot, monkeypatch, tmp_path):
    for available in (LAPTOP, DESKTOP):
        window = open_window(qtbot, monkeypatch, tmp_path / str(available.width()), available)
        load(qtbot, window)
        hint = window.minimumSizeHint()
        assert hint.width() <= MOST.width() and hint.height() <= MOST.height(), (available, hint)
        window.close()


def test_the_window_opens_within_the_screen_in_the_arrangement_that_fits(qtbot, monkeypatch, tmp_path):
    laptop = open_window(qtbot, monkeypatch, tmp_path / "laptop", LAPTOP)
    assert LAPTOP.contains(laptop.geometry()) and laptop.width() > 1300  # the room there is, not a postage stamp
    # One column: the heatmap over the budget, every other panel a tab beside one of them.
    assert shown(laptop) == {"dock-conversations", "dock-heatmap", "dock-budget"}
    docks = window_facts(laptop)["docks"]
    assert {name: d["tab_beside"] for name, d in docks.items() if not d["shown"]} == {
        "dock-hit-rate": "dock-heatmap", "dock-traffic": "dock-heatmap",
        "dock-system": "dock-budget", "dock-server": "dock-budget"}
    laptop.close()

    desktop = open_window(qtbot, monkeypatch, tmp_path / "desktop", DESKTOP)
    assert DESKTOP.contains(desktop.geometry()) and desktop.size() == QSize(1600, 1000)
    assert shown(desktop) == {"dock-conversations", "dock-heatmap", "dock-budget", "dock-hit-rate", "dock-traffic",
                              "dock-system"}  # two columns; the local server a tab beside System
    desktop.close()


def test_a_layout_saved_on_a_bigger_monitor_falls_back_to_one_that_fits(qtbot, monkeypatch, tmp_path):
    big = open_window(qtbot, monkeypatch, tmp_path, DESKTOP)
    big.close()  # remembers 1600 x 1000 and two columns
    assert saved_frame_size(big.settings.geometry).width() >= 1600

    small = open_window(qtbot, monkeypatch, tmp_path, LAPTOP)
    assert LAPTOP.contains(small.frameGeometry()) and "dock-traffic" not in shown(small)  # one column of tabs
    small.resize(780, 600)  # (within the offscreen platform's own 800 x 800 screen, which Qt also holds it to)
    small.docks["dock-system"].hide()  # the user's own layout...
    small.close()

    again = open_window(qtbot, monkeypatch, tmp_path, LAPTOP)  # ...fits this screen: kept as it was
    assert again.size() == QSize(780, 600) and again.docks["dock-system"].isHidden()
    again.close()


def test_a_reload_with_longer_text_moves_and_resizes_nothing(qtbot, monkeypatch, tmp_path):
    for available in (LAPTOP, DESKTOP):
        window = open_window(qtbot, monkeypatch, tmp_path / str(available.width()), available)
        first = load(qtbot, window)
        before = window_facts(window)
        assert before["clipped_labels"] == []

        # Converting to 4-bit: progress with a long message, then the model back with longer text everywhere.
        window.set_formats("q4_k", "original")
        window.bridge.client.emit(p.LoadProgress(0.4, "converting experts to 4-bit (Q4_K), layer 11 of 24, "
                                                      "into the cache folder ~/.cache/moescope/converted"))
        settle(qtbot, window)
        assert layout_signature(window_facts(window)) == layout_signature(before)
        longer = model_loaded(layers=24, experts=64, budget_slots=32)
        longer.name = "Qwen3-30B-A3B-Instruct-2507-a-very-long-checkpoint-name"
        longer.expert_format, longer.dtype = "q4_k", "bfloat16"
        longer.budget_note = "budget 1.00 MiB is below this model's minimum (3.00 MiB: 2 experts per layer); using it"
        longer.load_notes = ["the dense weights stay in bf16: this CPU has no AVX-512 BF16, the native kernels "
                             "widen them as they go", "a second note, as long as the first one, for good measure"]
        load(qtbot, window, longer)
        window.bridge.client.emit(p.BudgetChanged("40%", 10**9, [13] * 24, "a long note " * 12))
        settle(qtbot, window)
        after = window_facts(window)
        assert layout_signature(after) == layout_signature(before)
        assert after["clipped_labels"] == []
        summary = window.model_bar.details  # one line, elided, whole in its tooltip
        assert summary.elided() and summary.text() in summary.toolTip() and summary.height() < 2 * summary.fontMetrics().height()
        assert window.model_bar.name.text() == longer.name != first.name
        window.close()


def test_an_elided_label_keeps_its_whole_text_in_the_tooltip(qtbot):
    label = ElidedLabel("short")
    label.setToolTip("what it is")
    qtbot.addWidget(label)
    label.resize(400, 20)
    label.show()
    assert not label.elided() and label.toolTip() == "what it is"
    long = "a summary far too long for a narrow label, word after word after word"
    label.setText(long)
    label.resize(120, 20)
    assert label.elided() and label.text() == long
    assert label.toolTip() == f"{long}\n\nwhat it is"
    assert label.shown_text().endswith("…") and len(label.shown_text()) < len(long)
    assert label.minimumSizeHint().width() < 120 and label.sizeHint().width() > 120  # shrinks, asks for the whole
    assert clipped_labels(label) == []


def test_geometry_helpers():
    assert fitted_geometry(QRect(0, 0, 1920, 1040)).size() == QSize(1600, 1000)
    small = fitted_geometry(QRect(0, 0, 1366, 728))
    assert QRect(0, 0, 1366, 728).contains(small) and small.width() > 1300
    assert fits(QSize(1366, 728), QRect(0, 0, 1366, 728)) and not fits(QSize(1880, 1000), QRect(0, 0, 1600, 960))
    assert saved_frame_size(b"not a geometry") is None


# ----------------------------------------------------------------- the budget on a format change


def test_a_budget_keeps_its_share_of_the_experts_across_formats():
    all_bytes = 8 * 2**30
    assert same_share(str(4 * 2**30), 4 * 2**30, all_bytes) == "50.00%"  # the slider's bytes
    assert same_share("2GiB", 2 * 2**30, all_bytes) == "25.00%"
    assert same_share("all", all_bytes, all_bytes) == "all" and same_share("30%", 123, all_bytes) == "30%"
    assert same_share(str(9 * 2**30), 9 * 2**30, all_bytes) == "all"  # more than every expert: every expert
    assert same_share("1GiB", None, all_bytes) == "1GiB"  # no budget in force known: as it was


def test_a_format_change_reloads_with_the_same_share_and_says_when_it_was_clamped(qtbot, monkeypatch, tmp_path):
    window = open_window(qtbot, monkeypatch, tmp_path, LAPTOP)
    loaded = load(qtbot, window, model_loaded(layers=4, experts=8, budget_slots=8))
    half = loaded.all_expert_bytes // 2
    window.set_budget(str(half))  # the slider at half of the bf16 experts
    window.bridge.client.emit(p.BudgetChanged(str(half), half, [4] * 4, ""))
    qtbot.waitUntil(lambda: window.bridge.budget_bytes == half)  # events reach the window queued

    window.model_bar.expert_format.show_format("q4_k")
    window.model_bar.expert_format.activated.emit(window.model_bar.expert_format.currentIndex())
    reload = window.bridge.client.of(p.LoadModel)[-1]
    assert (reload.expert_format, reload.budget) == ("q4_k", "50.00%")  # half of the 4-bit experts, not all of them
    assert window.settings.budget_for("demo") == "50.00%"

    clamped = model_loaded(layers=4, experts=8, budget_slots=2)
    clamped.budget_note = "budget 1.00 KiB is below this model's minimum (8.00 KiB: 2 experts per layer); using the minimum"
    load(qtbot, window, clamped)
    assert clamped.budget_note in window.statusBar().currentMessage()
    assert window.budget.note.isVisible() and window.budget.note.text() == clamped.budget_note
    window.close()


# ----------------------------------------------------------------- the real window on xcb


def _screenshot(tmp_path: Path, screen: str, scale: str | None) -> tuple[dict, Path]:
    """`moescope --screenshot` on a private X server of this size: a reply at half the budget, then a
    reload with 4-bit experts and a second reply; the report holds the layout before and after."""
    out = tmp_path / "window.png"
    with xvfb_display(f"{screen}x24") as display:
        env = {k: v for k, v in os.environ.items() if k not in QT_ENV}
        env.update(QT_QPA_PLATFORM="xcb", DISPLAY=display, TMPDIR=str(tmp_path), **({"QT_SCALE_FACTOR": scale} if scale else {}))
        result = subprocess.run(
            [sys.executable, "-m", "app", "--screenshot", str(out), "--prompt", SPELL, "--model", "demo",
             "--budget", "50%", "--reload-as", "q4_k", "--timeout", "300"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=420, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return screenshot_report(result.stdout), out


def _assert_fits_and_readable(facts: dict) -> None:
    x, y, w, h = facts["frame"]
    assert QRect(*facts["available"]).contains(QRect(x, y, w, h)), facts  # the whole window on the screen
    assert facts["minimum_size_hint"][0] <= MOST.width() and facts["minimum_size_hint"][1] <= MOST.height()
    for name, dock in facts["docks"].items():
        assert not dock["closed"] and not dock["floating"], name
        assert dock["shown"] or dock["tab_beside"], f"{name} is neither shown nor a tab beside a shown dock"
        if dock["shown"]:
            assert QRect(0, 0, w, h).contains(QRect(*dock["geometry"])), (name, dock)
    assert facts["clipped_labels"] == []


@pytest.mark.process
@pytest.mark.parametrize(("screen", "scale", "wide"), [("1366x768", None, False), ("1920x1080", None, True),
                                                         ("1920x1080", "1.5", False)])
def test_the_real_window_fits_the_screen_and_a_format_change_moves_nothing(tmp_path, screen, scale, wide):
    report, png = _screenshot(tmp_path, screen, scale)
    assert report["platform"] == "xcb"
    assert re.search(r"e-l-e-p-h-a-n-t", report["reply"]), report["reply"]
    assert_heatmap_drawn(png, report)
    before, after = report["layout"], report["layout_after_reload"]
    width, height = (int(v) for v in screen.split("x"))
    factor = float(scale or 1)
    assert before["screen"] == [0, 0, round(width / factor), round(height / factor)]  # device-independent pixels
    _assert_fits_and_readable(before)
    _assert_fits_and_readable(after)
    assert before["docks"]["dock-traffic"]["shown"] is wide  # two columns on a wide screen, tabs on a narrow one
    assert layout_signature(after) == layout_signature(before)
    # The reload happened, in 4-bit, and kept half of the experts.
    model, reloaded = report["model"], report["model_after_reload"]
    assert (model["expert_format"], reloaded["expert_format"]) == ("original", "q4_k")
    assert reloaded["all_expert_bytes"] < model["all_expert_bytes"]
    for facts in (model, reloaded):
        assert facts["budget_bytes"] == pytest.approx(facts["all_expert_bytes"] / 2, rel=0.15)
