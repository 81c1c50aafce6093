"""The demo model's reach made visible: on an empty chat it offers one example prompt per skill its card
claims, phrased as it was trained, with a line saying what it is; a click sends it, and the engine's
reply is that skill's answer."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.engine_bridge import EngineBridge
from app.main_window import MainWindow
from app.models.history import HistoryStore
from app.settings import AppSettings
from engine import protocol as p
from engine.demo.corpus import EXAMPLES
from resources import DEMO_MODEL_DIR
from tests.helpers.app_fixtures import ScriptedClient, model_loaded

CARD = json.loads((DEMO_MODEL_DIR / "moescope_demo.json").read_text())
CLAIMED = CARD["skills"]


def shown(window: MainWindow) -> list[str]:
    view = window.chat_view
    return [b.text() for b in view.examples.buttons] if view.examples.isVisible() else []


@pytest.fixture
def scripted(qtbot, tmp_path):
    """The window with a scripted engine: the test says which model loaded."""
    holder: dict = {}

    def factory(on_event):
        holder["client"] = ScriptedClient(on_event)
        return holder["client"]

    win = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"),
                     bridge=EngineBridge(client_factory=factory))
    qtbot.addWidget(win)
    win.show()
    win.start_engine("demo", "25%")
    win.client = holder["client"]
    return win


def test_the_demo_offers_its_claimed_skills_and_a_click_sends_one(qtbot, scripted):
    scripted.client.emit(_loaded(str(DEMO_MODEL_DIR)))
    qtbot.waitUntil(lambda: scripted.chat.ready, timeout=5000)
    view = scripted.chat_view
    assert shown(scripted) == [EXAMPLES[skill].user for skill in CLAIMED] and len(CLAIMED) == 8
    about = view.examples.about.text()
    assert "3.4 M parameters" in about and "demo model" in about and "\n" not in about
    assert not view.empty_hint.isVisible()  # "Ask the model anything" is not true of this one

    spell = next(b for b in view.examples.buttons if b.text() == EXAMPLES["spell"].user)
    qtbot.mouseClick(spell, Qt.MouseButton.LeftButton)
    [generate] = scripted.client.of(p.Generate)
    assert generate.messages[-1] == {"role": "user", "content": "Spell the word 'garden'."}
    assert view.widgets()[0].text == "Spell the word 'garden'."
    assert shown(scripted) == []  # the chat has messages now

    scripted.chat.new_chat()
    assert shown(scripted) == [EXAMPLES[skill].user for skill in CLAIMED]


def test_another_model_gets_the_general_hint_and_no_examples(qtbot, scripted):
    scripted.client.emit(model_loaded())  # /models/tiny-test: no demo card
    qtbot.waitUntil(lambda: scripted.chat.ready, timeout=5000)
    assert shown(scripted) == [] and scripted.chat_view.empty_hint.isVisible()


def test_the_demo_card_shows_the_same_examples():
    card = (DEMO_MODEL_DIR / "README.md").read_text()
    for skill in CLAIMED:
        assert f"{EXAMPLES[skill].user} → {EXAMPLES[skill].assistant}" in card, skill


def _loaded(path: str) -> p.ModelLoaded:
    event = model_loaded()
    event.name, event.path = "demo", path
    return event


@pytest.mark.process
def test_each_example_gets_its_skills_answer_from_the_engine(qtbot, tmp_path):
    from tests.test_app_engine import REPLY_MS, greedy, open_window

    window, events = open_window(qtbot, tmp_path, DEMO_MODEL_DIR, budget="25%")
    greedy(window, 32)
    replies = {}
    for skill in CLAIMED:
        window.chat.new_chat()
        button = next(b for b in window.chat_view.examples.buttons if b.text() == EXAMPLES[skill].user)
        before = len(events.done())
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda n=before: len(events.done()) > n, timeout=REPLY_MS)
        replies[skill] = window.chat_view.widgets()[-1].text
        assert shown(window) == []
    assert replies == {skill: EXAMPLES[skill].assistant for skill in CLAIMED}  # "11", "g-a-r-d-e-n", "Paris", ...
