"""The window driven against a remote engine, for GUI tests: open it, connect it, send a message."""

from __future__ import annotations

from app.engine_bridge import EngineBridge
from app.main_window import MainWindow
from app.models.history import HistoryStore
from app.settings import AppSettings
from engine import protocol as p
from tests.helpers.app_fixtures import Recorder, ScriptedClient

REPLY_MS = 60_000
LOAD_MS = 180_000


def window_for(qtbot, tmp_path, bridge: EngineBridge | None = None) -> tuple[MainWindow, Recorder]:
    window = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"),
                        bridge=bridge or EngineBridge(ScriptedClient))
    qtbot.addWidget(window)
    recorder = Recorder(window)
    window.show()
    return window, recorder


def connected(qtbot, window: MainWindow, url: str, model: str = "") -> None:
    window.use_remote(url, None, model)
    qtbot.waitUntil(lambda: window.chat.ready or window.banner.isVisible(), timeout=20_000)
    assert window.chat.ready, window.banner.label.text()


def say(qtbot, window: MainWindow, events: Recorder, text: str) -> p.Done:
    before = len(events.done())
    window.chat_view.composer.edit.setPlainText(text)
    window.chat_view.composer.send_requested.emit(text)
    qtbot.waitUntil(lambda: len(events.done()) > before, timeout=REPLY_MS)
    return events.done()[-1]
