"""The window against a real engine worker (spawned process, tiny checkpoint), offscreen.

Every wait ends on an event or a state (qtbot.waitUntil / waitSignal with a timeout), never on a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.main_window import MainWindow
from app.models.history import HistoryStore
from app.settings import AppSettings
from engine import protocol as p
from engine.cli.main import main as moescope_cli
from tests.helpers.app_fixtures import Recorder
from tests.helpers.checkpoints import save_tiny_checkpoint

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
LOAD_MS = 120_000  # spawning the worker imports torch + transformers: slow on a busy 2-core machine
REPLY_MS = 60_000


@pytest.fixture(scope="module")
def endless_checkpoint(tmp_path_factory) -> Path:
    """No EOS anywhere (config, generation config, tokenizer): replies run to max tokens, so there is
    always a reply to act on mid-stream."""
    path = save_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("app-endless") / "mixtral", eos_token_id=None)
    tokenizer_config = path / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config.pop("eos_token", None)  # the engine falls back to the tokenizer's EOS
    tokenizer_config.write_text(json.dumps(config))
    return path


def open_window(qtbot, tmp_path: Path, model: Path | None, budget: str = "all") -> tuple[MainWindow, Recorder]:
    window = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"))
    qtbot.addWidget(window)
    recorder = Recorder(window)
    window.show()
    if model is not None:
        window.start_engine(str(model), budget)
        qtbot.waitUntil(lambda: window.chat.ready or window.banner.isVisible(), timeout=LOAD_MS)
        assert window.chat.ready, window.banner.label.text()
    return window, recorder


def greedy(window: MainWindow, max_tokens: int) -> None:
    form = window.chat_view.settings
    form.temperature.setValue(0.0)
    form.max_tokens.setValue(max_tokens)


def test_reply_streams_into_the_chat_and_equals_the_engine(qtbot, tmp_path, endless_checkpoint, capsys):
    window, events = open_window(qtbot, tmp_path, endless_checkpoint)
    greedy(window, 24)
    window.chat_view.composer.edit.setPlainText("Hello there")
    qtbot.keyClick(window.chat_view.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(events.done()), timeout=REPLY_MS)
    done = events.done()[-1]
    assert done.finish_reason == "length" and len(done.token_ids) == 24
    streamed = "".join(e.text for e in events.of(p.Token) if e.request_id == done.request_id)
    reply = window.chat_view.widgets()[-1]
    assert reply.text == streamed == done.text  # the chat shows exactly what the engine produced
    assert "decode" in reply.stats.text() and "hit rate" in reply.stats.text()
    stored = window.store.messages(window.chat.conversation.id)
    assert [(m.role, m.content) for m in stored] == [("user", "Hello there"), ("assistant", done.text)]

    # the headless CLI, greedy on the same prompt, says the same thing
    capsys.readouterr()
    assert moescope_cli(["generate", "--model", str(endless_checkpoint), "--prompt", "Hello there",
                         "--max-new-tokens", "24", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["text"] == done.text and cli["token_ids"] == done.token_ids


def test_demo_model_answers_in_the_window_like_the_engine(qtbot, tmp_path, capsys):
    # What a first start shows: the embedded demo model, a small budget, a question it knows.
    from resources import DEMO_MODEL_DIR

    window, events = open_window(qtbot, tmp_path, DEMO_MODEL_DIR, budget="25%")
    greedy(window, 32)
    window.chat.send("Reverse the word 'engine'.")
    qtbot.waitUntil(lambda: bool(events.done()), timeout=REPLY_MS)
    done = events.done()[-1]
    assert done.finish_reason == "eos" and done.text == "enigne"
    assert window.chat_view.widgets()[-1].text == done.text
    assert events.of(p.TelemetrySnapshot)[-1].activation_request.numpy().sum() > 0  # the heatmap's data
    capsys.readouterr()
    assert moescope_cli(["generate", "--model", "demo", "--prompt", "Reverse the word 'engine'.",
                         "--budget", "25%", "--max-new-tokens", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == done.text


def test_panels_budget_slider_and_stop_against_the_engine(qtbot, tmp_path, endless_checkpoint):
    window, events = open_window(qtbot, tmp_path, endless_checkpoint)
    greedy(window, 40)
    window.chat.send("Tell me about experts")
    qtbot.waitUntil(lambda: bool(events.done()), timeout=REPLY_MS)

    # the heatmap and hit-rate panels got the engine's data and drew it
    # The panel redraws on its refresh tick, so the reply's last snapshot may land a tick after Done:
    # wait for a drawn picture with this reply's activations, not just any earlier (empty) one.
    qtbot.waitUntil(lambda: window.heatmap.data is not None and window.heatmap.data.counts.sum() > 0, timeout=5000)
    loaded = events.of(p.ModelLoaded)[-1]
    assert window.heatmap.image.image.shape == (loaded.num_layers, loaded.num_experts)
    assert window.heatmap.data.counts.sum() > 0 and window.heatmap.peak > 0
    assert len(window.hit_rate.overall.getData()[0]) > 0
    assert "Since load" in window.hit_rate.figures.text()
    assert window.traffic.link.text() and window.system.state.text() in ("idle", "decoding", "prefill")

    # dragging the slider to the minimum reaches the engine; the next snapshot has the new slots
    slider = window.budget.slider
    assert slider.value() == slider.maximum()
    mark = len(events.events)
    slider.setSliderDown(True)
    slider.setSliderPosition(0)
    slider.setSliderDown(False)
    qtbot.waitUntil(lambda: any(isinstance(e, p.BudgetChanged) for e in events.events[mark:]), timeout=REPLY_MS)
    floor = [loaded.top_k] * loaded.num_layers
    changed = next(e for e in events.events[mark:] if isinstance(e, p.BudgetChanged))
    assert changed.slots_per_layer == floor and changed.budget_bytes == loaded.min_budget_bytes
    qtbot.waitUntil(lambda: any(isinstance(e, p.TelemetrySnapshot) and e.slots_per_layer == floor
                                for e in events.events[mark:]), timeout=REPLY_MS)
    qtbot.waitUntil(lambda: window.budget.slots == floor and window.budget.pending is None, timeout=5000)

    # the next reply runs at the new budget; Esc stops it within a token
    greedy(window, 200)
    before = len(events.done())
    window.chat.send("Now a long one")
    qtbot.waitUntil(lambda: window.chat.active is not None and len(window.chat.active.text) > 0, timeout=REPLY_MS)
    qtbot.keyClick(window.chat_view.composer.edit, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: len(events.done()) > before, timeout=REPLY_MS)
    stopped = events.done()[-1]
    assert stopped.finish_reason == "cancelled" and len(stopped.token_ids) < 200
    assert stopped.stats.budget_bytes == loaded.min_budget_bytes
    assert "stopped" in window.chat_view.widgets()[-1].stats.text()
    assert window.chat_view.widgets()[-1].text == stopped.text


def test_engine_killed_mid_reply_shows_banner_and_restart_keeps_the_conversation(qtbot, tmp_path, endless_checkpoint):
    window, events = open_window(qtbot, tmp_path, endless_checkpoint)
    loaded = events.of(p.ModelLoaded)[-1]
    window.set_budget(str(loaded.min_budget_bytes))  # restarting must keep the budget in force
    qtbot.waitUntil(lambda: bool(events.of(p.BudgetChanged)), timeout=REPLY_MS)
    greedy(window, 200)
    window.chat.send("first question")
    qtbot.waitUntil(lambda: window.chat.active is not None and len(window.chat.active.text) > 0, timeout=REPLY_MS)
    old_pid = window.bridge.pid
    os.kill(old_pid, signal.SIGKILL)

    qtbot.waitUntil(lambda: window.banner.isVisible(), timeout=REPLY_MS)
    assert window.banner.restart_button.isVisible() and "stopped" in window.banner.label.text()
    assert not window.chat.streaming and not window.chat.ready
    conversation = window.chat.conversation.id
    before = [(m.role, m.content) for m in window.store.messages(conversation)]
    assert before[0] == ("user", "first question") and before[1][0] == "assistant"

    qtbot.mouseClick(window.banner.restart_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.chat.ready, timeout=LOAD_MS)
    assert window.bridge.pid != old_pid and not window.banner.isVisible()
    reloaded = events.of(p.ModelLoaded)[-1]
    assert reloaded.budget_bytes == loaded.min_budget_bytes  # the last budget, not the first
    assert [(w.role, w.text) for w in window.chat_view.widgets()] == before  # the conversation is intact

    greedy(window, 8)
    done_before = len(events.done())
    window.chat.send("second question")
    qtbot.waitUntil(lambda: len(events.done()) > done_before, timeout=REPLY_MS)
    assert events.done()[-1].finish_reason == "length"
    assert [m.role for m in window.store.messages(conversation)] == ["user", "assistant", "user", "assistant"]


def test_history_survives_an_app_restart(qtbot, tmp_path, endless_checkpoint):
    window, events = open_window(qtbot, tmp_path, endless_checkpoint)
    greedy(window, 12)
    window.chat.send("Remember me")
    qtbot.waitUntil(lambda: bool(events.done()), timeout=REPLY_MS)
    reply = events.done()[-1].text
    window.close()

    again, _ = open_window(qtbot, tmp_path, None)  # a new window over the same SQLite file, no engine needed
    assert again.conversations.titles() == ["Remember me"]
    assert [(w.role, w.text) for w in again.chat_view.widgets()] == [("user", "Remember me"), ("assistant", reply)]
    assert "decode" in again.chat_view.widgets()[-1].stats.text()


def test_screenshot_mode_saves_the_window_and_exits_zero(tmp_path, endless_checkpoint):
    out = tmp_path / "shot.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    result = subprocess.run(
        [sys.executable, "-m", "app", "--screenshot", str(out), "--prompt", "Hi", "--model", str(endless_checkpoint),
         "--timeout", "240", "--show", "traffic"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    from PySide6.QtGui import QImage

    image = QImage(str(out))
    # the whole window, as large as the offscreen platform's 800 x 800 screen lets it be (it fits its screen)
    assert not image.isNull() and image.width() >= 760 and image.height() >= 700
    # --show: the traffic panel's tab is the one in front (on this small screen the panels are tabs)
    docks = json.loads(result.stdout.strip().splitlines()[-1])["layout"]["docks"]
    assert docks["dock-traffic"]["shown"] and not docks["dock-hit-rate"]["shown"]
