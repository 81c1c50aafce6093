"""The chat and the window around it, with a scripted engine client (no engine process)."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.chat.composer import Composer
from app.chat.controller import title_from
from app.engine_bridge import EngineBridge
from app.main_window import MainWindow
from app.models.export import to_json, to_markdown
from app.models.history import HistoryStore
from app.models.markdown_render import HAVE_PYGMENTS, close_open_fence, render_markdown
from app.models.stats_format import reply_stats_line
from app.settings import AppSettings
from engine import protocol as p
from tests.helpers.app_fixtures import ScriptedClient, model_loaded, snapshot

STATS = p.ReplyStats(prefill_tokens=12, decode_tokens=5, ttft_s=0.25, prefill_tokens_per_s=48.0, decode_tokens_per_s=20.0,
             hit_rate=0.9, decode_hit_rate=0.92, hits=90, misses=10, bytes_loaded=1024, stall_s=0.01,
             budget_bytes=4096, peak_rss_bytes=10**8, total_s=0.5)


# ----------------------------------------------------------------- Qt-free parts
def test_history_store_round_trip(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    c = store.create_conversation("Hello world", system_prompt="be brief")
    user = store.add_message(c.id, "user", "hi")
    reply = store.add_message(c.id, "assistant", "")
    store.update_message(reply.id, "hello **there**", STATS, "eos")
    other = store.create_conversation("Rust lifetimes")
    store.rename(other.id, "Borrow checker")
    assert [x.title for x in store.conversations("hello")] == ["Hello world"]
    assert [x.title for x in store.conversations("BORROW")] == ["Borrow checker"]
    assert store.conversations("100%") == []  # LIKE wildcards are literal
    store.close()

    again = HistoryStore(tmp_path / "h.sqlite3")
    messages = again.messages(c.id)
    assert [(m.role, m.content) for m in messages] == [("user", "hi"), ("assistant", "hello **there**")]
    assert messages[1].stats == STATS and messages[1].finish_reason == "eos"
    assert again.conversation(c.id).system_prompt == "be brief"
    again.delete_messages_from(c.id, reply.id)
    assert [m.id for m in again.messages(c.id)] == [user.id]
    again.delete_conversation(c.id)
    assert again.messages(c.id) == [] and again.conversation(c.id) is None


def test_export_markdown_and_json(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    c = store.create_conversation("Export me", system_prompt="sys")
    store.add_message(c.id, "user", "question")
    store.add_message(c.id, "assistant", "answer", STATS, "eos")
    md = to_markdown(store.conversation(c.id), store.messages(c.id))
    assert md.startswith("# Export me") and "## You\n\nquestion" in md and "## Assistant\n\nanswer" in md
    assert "hit rate 90.0%" in md and "## System\n\nsys" in md
    data = json.loads(to_json(store.conversation(c.id), store.messages(c.id)))
    assert data["title"] == "Export me" and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["stats"]["hit_rate"] == 0.9 and data["sampling"]["temperature"] == 0.7


def test_markdown_rendering():
    html = render_markdown("**bold** <script>alert(1)</script>\n\n```python\nx = 1 < 2\n```")
    assert "<strong>bold</strong>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html  # raw HTML is shown, never interpreted
    assert "<pre" in html and "&lt;" in html
    if HAVE_PYGMENTS:
        assert "style=\"color" in html  # highlighted with inline styles
    assert close_open_fence("text\n```py\ncode") == "text\n```py\ncode\n```"
    assert close_open_fence("```\na\n```") == "```\na\n```"


def test_stats_line_and_titles():
    line = reply_stats_line(STATS)
    assert "prefill 48.0 tok/s" in line and "decode 20.0 tok/s" in line and "TTFT 250 ms" in line
    assert "hit rate 90.0%" in line
    assert title_from("  a   b\nc ") == "a b c"
    assert len(title_from("x" * 100)) == 48


# ----------------------------------------------------------------- widgets
def test_composer_enter_sends_and_shift_enter_adds_a_line(qtbot):
    composer = Composer()
    qtbot.addWidget(composer)
    sent: list[str] = []
    composer.send_requested.connect(sent.append)
    qtbot.keyClicks(composer.edit, "line one")
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(composer.edit, "line two")
    assert sent == []
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    assert sent == ["line one\nline two"] and composer.edit.toPlainText() == ""
    composer.set_streaming(True)
    assert composer.button.text() == "Stop"
    with qtbot.waitSignal(composer.stop_requested):
        composer.button.click()


@pytest.fixture
def window(qtbot, tmp_path):
    holder: dict = {}

    def factory(on_event):
        holder["client"] = ScriptedClient(on_event)
        return holder["client"]

    bridge = EngineBridge(client_factory=factory)
    win = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"),
                     bridge=bridge)
    qtbot.addWidget(win)
    win.show()
    win.start_engine("/models/tiny-test", "all")
    client: ScriptedClient = holder["client"]
    client.emit(model_loaded())
    qtbot.waitUntil(lambda: win.chat.ready, timeout=5000)
    win.client = client  # for the tests
    return win


def _stream(qtbot, win, client, parts: list[str], stats=STATS, reason="eos"):
    rid = client.of(p.Generate)[-1].request_id
    for part in parts:
        client.emit(p.Token(rid, part, [1]))
    client.emit(snapshot(t=1.0))
    client.emit(p.Done(rid, reason, "".join(parts), [1] * len(parts), stats))
    qtbot.waitUntil(lambda: not win.chat.streaming, timeout=5000)


def test_send_stream_regenerate_edit_and_stop(qtbot, window):
    win, client = window, window.client
    assert client.of(p.LoadModel)[0].path == "/models/tiny-test"
    win.chat_view.settings.temperature.setValue(0.0)  # draft settings of the new chat
    win.chat_view.composer.edit.setPlainText("What is MoE?")
    qtbot.keyClick(win.chat_view.composer.edit, Qt.Key.Key_Return)
    generate = client.of(p.Generate)[-1]
    assert generate.messages == [{"role": "user", "content": "What is MoE?"}]
    assert generate.sampling.temperature == 0.0
    assert win.chat_view.composer.button.text() == "Stop"
    _stream(qtbot, win, client, ["Mixture ", "of ", "**experts**"])
    widgets = win.chat_view.widgets()
    assert [w.role for w in widgets] == ["user", "assistant"]
    assert widgets[1].text == "Mixture of **experts**"
    assert "<b>experts</b>" in widgets[1].body.toHtml() or "font-weight" in widgets[1].body.toHtml()
    assert "decode 20.0 tok/s" in widgets[1].stats.text() and "hit rate 90.0%" in widgets[1].stats.text()
    assert win.conversations.titles() == ["What is MoE?"]

    # regenerate the last reply
    widgets[1].regen_button.click()
    assert len(client.of(p.Generate)) == 2
    _stream(qtbot, win, client, ["Again"])
    assert [w.text for w in win.chat_view.widgets()] == ["What is MoE?", "Again"]

    # a second turn carries the history
    win.chat.send("And why?")
    assert client.of(p.Generate)[-1].messages == [
        {"role": "user", "content": "What is MoE?"}, {"role": "assistant", "content": "Again"},
        {"role": "user", "content": "And why?"},
    ]
    _stream(qtbot, win, client, ["Because."])

    # edit the first message and resend: everything after it goes
    first = win.chat_view.widgets()[0]
    first.begin_edit()
    first.editor.setPlainText("What is a dense model?")
    first.save_button.click()
    assert client.of(p.Generate)[-1].messages == [{"role": "user", "content": "What is a dense model?"}]
    _stream(qtbot, win, client, ["All weights, every token."])
    store = win.store
    conversation = win.chat.conversation
    assert [m.content for m in store.messages(conversation.id)] == ["What is a dense model?", "All weights, every token."]

    # Esc stops: the engine is asked to cancel this request
    win.chat.send("Long story please")
    rid = client.of(p.Generate)[-1].request_id
    client.emit(p.Token(rid, "Once", [1]))
    win.activateWindow()
    qtbot.waitUntil(win.isActiveWindow, timeout=5000)
    qtbot.keyClick(win.chat_view.composer.edit, Qt.Key.Key_Escape)
    assert client.of(p.Cancel)[-1].request_id == rid
    client.emit(p.Done(rid, "cancelled", "Once", [1], STATS))
    qtbot.waitUntil(lambda: not win.chat.streaming, timeout=5000)
    assert "stopped" in win.chat_view.widgets()[-1].stats.text()


def test_a_block_being_denoised_shows_as_a_draft_until_its_tokens_arrive(qtbot, window):
    # Block-diffusion models: after each denoising step the engine sends the block as it reads now.
    win, client = window, window.client
    win.chat.send("Write a haiku")
    rid = client.of(p.Generate)[-1].request_id
    reply = win.chat_view.widgets()[-1]
    client.emit(p.Draft(rid, "Snow on sleeping pines"))
    qtbot.waitUntil(lambda: "sleeping pines" in reply.body.toPlainText(), timeout=5000)
    client.emit(p.Draft(rid, "Snow on silent pines"))
    qtbot.waitUntil(lambda: "silent pines" in reply.body.toPlainText(), timeout=5000)
    assert "sleeping" not in reply.body.toPlainText()  # each draft replaces the last
    client.emit(p.Token(rid, "Snow on silent pines", [1]))
    client.emit(p.Done(rid, "eos", "Snow on silent pines", [1], STATS))
    qtbot.waitUntil(lambda: not win.chat.streaming, timeout=5000)
    assert reply.body.toPlainText().strip() == "Snow on silent pines"  # the draft is gone, the text stays once
    assert win.store.messages(win.chat.conversation.id)[-1].content == "Snow on silent pines"


def test_streaming_writes_are_throttled_and_survive(qtbot, window):
    win, client = window, window.client
    win.chat.send("hi")
    rid = client.of(p.Generate)[-1].request_id
    reply_id = win.chat.active.message_id
    writes: list[str] = []
    store_update = win.store.update_message

    def counting(message_id, content, stats=None, finish_reason=None):
        writes.append(content)
        store_update(message_id, content, stats, finish_reason)

    win.store.update_message = counting
    for i in range(200):
        client.emit(p.Token(rid, str(i % 10), [1]))
    qtbot.waitUntil(lambda: len(win.chat.active.text) == 200, timeout=5000)
    qtbot.waitUntil(lambda: bool(writes) and len(writes[-1]) == 200, timeout=3000)  # the half-second save
    assert len(writes) <= 3  # not one write per token
    assert win.store.messages(win.chat.conversation.id)[-1].content == win.chat.active.text
    assert win.store.messages(win.chat.conversation.id)[-1].id == reply_id


def test_crash_shows_banner_and_restart_reloads_with_the_budget_in_force(qtbot, window):
    win, client = window, window.client
    win.set_budget("4096")
    win.chat.send("hello")
    rid = client.of(p.Generate)[-1].request_id
    client.emit(p.Token(rid, "partial", [1]))
    client.emit(p.Error("engine-crashed", "the engine was stopped by SIGKILL", False))
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=5000)
    assert "SIGKILL" in win.banner.label.text() and win.banner.restart_button.isVisible()
    assert not win.chat.streaming and "failed" in win.chat_view.widgets()[-1].stats.text()
    assert win.chat_view.widgets()[-1].text == "partial"
    win.banner.restart_button.click()
    assert client.restarts == 1 and client.last_load.budget == "4096"
    client.emit(model_loaded())
    qtbot.waitUntil(lambda: win.chat.ready and not win.banner.isVisible(), timeout=5000)
    # the failed partial reply is kept for the user but not sent back to the model
    win.chat.send("again")
    assert client.of(p.Generate)[-1].messages == [
        {"role": "user", "content": "hello"}, {"role": "user", "content": "again"},
    ]


def test_out_of_memory_offers_restart_and_dismiss(qtbot, window):
    win, client = window, window.client
    client.emit(p.Error("out-of-memory", "the engine ran out of memory", True))
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=5000)
    assert win.banner.restart_button.isVisible() and win.banner.dismiss_button.isVisible()
    assert "Out of memory" in win.banner.label.text()


def test_conversations_sidebar_search_rename_delete_export(qtbot, window, tmp_path, monkeypatch):
    win, client = window, window.client
    for text in ("alpha question", "beta question"):
        win.chat.new_chat()
        win.chat.send(text)
        _stream(qtbot, win, client, ["ok"])
    assert win.conversations.titles() == ["beta question", "alpha question"]
    win.conversations.search.setText("ALPHA")
    assert win.conversations.titles() == ["alpha question"]
    win.conversations.search.setText("")
    alpha = next(c for c in win.store.conversations() if c.title == "alpha question")
    win.chat.rename(alpha.id, "Renamed")
    assert "Renamed" in win.conversations.titles()
    out = win.export_conversation(alpha.id, "markdown", str(tmp_path / "a.md"))
    assert out.read_text().startswith("# Renamed")
    out = win.export_conversation(alpha.id, "json", str(tmp_path / "a.json"))
    assert json.loads(out.read_text())["messages"][0]["content"] == "alpha question"
    win.chat.open(alpha.id)
    assert [w.text for w in win.chat_view.widgets()] == ["alpha question", "ok"]
    win.chat.delete(alpha.id)
    assert win.conversations.titles() == ["beta question"] and win.chat_view.widgets() == []


def test_message_sent_while_loading_is_queued(qtbot, tmp_path):
    holder: dict = {}
    bridge = EngineBridge(client_factory=lambda cb: holder.setdefault("c", ScriptedClient(cb)))
    win = MainWindow(settings=AppSettings(str(tmp_path / "s.ini")), store=HistoryStore(tmp_path / "h.sqlite3"),
                     bridge=bridge)
    qtbot.addWidget(win)
    win.start_engine("demo")
    win.chat.send("early bird")
    client = holder["c"]
    assert client.of(p.Generate) == []
    client.emit(model_loaded())
    qtbot.waitUntil(lambda: bool(client.of(p.Generate)), timeout=5000)
    assert client.of(p.Generate)[0].messages[-1]["content"] == "early bird"


def test_settings_persist_theme_layout_budget_and_policy(qtbot, tmp_path):
    settings_path = str(tmp_path / "s.ini")

    def make():
        bridge = EngineBridge(client_factory=ScriptedClient)
        win = MainWindow(settings=AppSettings(settings_path), store=HistoryStore(tmp_path / "h.sqlite3"), bridge=bridge)
        qtbot.addWidget(win)
        return win

    win = make()
    win.show()
    win.start_engine("/models/m", None)
    win.bridge.client.emit(model_loaded())
    qtbot.waitUntil(lambda: win.chat.ready, timeout=5000)
    win.set_theme("dark")
    win.set_budget("25%")
    win.set_policy("swapmoe")
    win.docks["dock-traffic"].hide()
    win.close()

    again = make()
    again.show()
    assert again.themes.choice == "dark" and again.themes.theme.name == "dark"
    assert not again.docks["dock-traffic"].isVisible() and again.docks["dock-heatmap"].isVisible()
    assert again.settings.last_model == "/models/m"
    again.start_engine()
    load = again.bridge.client.of(p.LoadModel)[-1]
    assert (load.path, load.budget, load.policy) == ("/models/m", "25%", "swapmoe")
    again.restore_default_layout()
    assert again.docks["dock-traffic"].isVisible()


def test_a_model_that_fails_to_load_is_reported_and_dismissable(qtbot, tmp_path):
    bridge = EngineBridge(client_factory=ScriptedClient)
    win = MainWindow(settings=AppSettings(str(tmp_path / "s.ini")), store=HistoryStore(tmp_path / "h.sqlite3"),
                     bridge=bridge)
    qtbot.addWidget(win)
    win.show()
    win.start_engine("/not/a/model")
    bridge.client.emit(p.Error("bad-checkpoint", "no config.json in /not/a/model", True))
    qtbot.waitUntil(win.banner.isVisible, timeout=5000)
    assert "config.json" in win.banner.label.text()
    assert win.banner.dismiss_button.isVisible() and not win.banner.restart_button.isVisible()
    assert "not loaded" in win.model_bar.details.text() and not win.chat.ready
    assert win.settings.last_model != "/not/a/model"  # only a model that loaded is remembered
    win.banner.dismiss_button.click()
    assert not win.banner.isVisible()
