"""A chat that never gets stuck: a history longer than the model's context keeps answering (the oldest
turns left out of what the model sees, nothing deleted), a message too long alone is refused before
anything is generated, naming its length, and "stop" refuses with one clear message instead.

The fitting itself against the demo model's tokenizer, then the window (a real engine worker),
`moescope chat` (a subprocess reading stdin) and `moescope serve` (which never trims) on the demo
model, whose context is 512 tokens."""

from __future__ import annotations

import pytest

from engine import protocol as p
from engine.decode.context_window import fit_chat, reply_room
from engine.errors import PromptTooLongError

CONTEXT = 512
PAD = "Tell me more about the mixture of experts, please. "  # long-ish turns reach 3x the context quickly


@pytest.fixture(scope="module")
def encode():
    from transformers import AutoTokenizer

    from resources import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)

    def encode(messages: list[dict]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return encode


def history(turns: int, system: str = "Be brief.") -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    for i in range(turns):
        messages += [{"role": "user", "content": f"{i}: {PAD * 2}"}, {"role": "assistant", "content": f"reply {i}"}]
    return [*messages, {"role": "user", "content": "Hello!"}]


# ----------------------------------------------------------------- the fitting (tokenizer only)
def test_a_history_that_fits_is_sent_whole(encode):
    messages = history(1)
    fitted = fit_chat(encode, messages, CONTEXT, 64, "drop-oldest")
    assert fitted.ids == encode(messages) and (fitted.first_message, fitted.dropped_messages) == (1, 0)


def test_drop_oldest_leaves_out_whole_turns_and_keeps_room_for_the_reply(encode):
    messages = history(14)
    assert len(encode(messages)) > 3 * CONTEXT
    fitted = fit_chat(encode, messages, CONTEXT, 512, "drop-oldest")
    kept = messages[:1] + messages[fitted.first_message:]
    assert fitted.ids == encode(kept)  # the system prompt and the newest turns, whole
    assert messages[fitted.first_message]["role"] == "user" and kept[-1]["content"] == "Hello!"
    assert fitted.dropped_messages == fitted.first_message - 1 > 0
    room = reply_room(CONTEXT, 512)
    assert room == CONTEXT // 4 and len(fitted.ids) + room <= CONTEXT
    one_more = messages[:1] + messages[fitted.first_message - 2:]  # the fewest dropped: one more turn overflows
    assert len(encode(one_more)) + room > CONTEXT


def test_a_message_too_long_alone_is_refused_with_its_length(encode):
    messages = history(3)
    messages[-1]["content"] = PAD * 12
    alone = len(encode(messages[:1] + messages[-1:]))
    for overflow in ("drop-oldest", "stop"):
        with pytest.raises(PromptTooLongError) as refused:
            fit_chat(encode, messages, CONTEXT, 64, overflow)
        assert str(refused.value) == f"this message is {alone:,} tokens; the model's context is 512 tokens — shorten it"


def test_stop_refuses_the_whole_conversation_in_one_clear_message(encode):
    messages = history(14)
    with pytest.raises(PromptTooLongError) as refused:
        fit_chat(encode, messages, CONTEXT, 64, "stop")
    assert str(refused.value) == (f"the conversation is {len(encode(messages)):,} tokens but this model's context "
                                  "is 512 tokens; drop its oldest turns or start a new one")
    short = history(1)
    assert fit_chat(encode, short, CONTEXT, 64, "stop").ids == encode(short)  # what fits goes as it is


def test_an_older_history_file_gains_the_overflow_setting(tmp_path):
    import sqlite3

    from app.models.history import HistoryStore

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)  # the first release's table, before the context settings
    old.executescript("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, "
                      "updated REAL NOT NULL, system_prompt TEXT NOT NULL DEFAULT '', sampling TEXT NOT NULL DEFAULT "
                      "'{}', model TEXT NOT NULL DEFAULT '');"
                      "INSERT INTO conversations(title, created, updated) VALUES ('Old chat', 1, 1);")
    old.commit()
    old.close()
    store = HistoryStore(path)
    conversation = store.conversations()[0]
    assert (conversation.title, conversation.context_overflow, conversation.memory_start) == ("Old chat", "drop-oldest", None)
    store.set_context_overflow(conversation.id, "stop")
    store.set_memory_start(conversation.id, 7)
    store.close()
    again = HistoryStore(path).conversation(conversation.id)
    assert (again.context_overflow, again.memory_start) == ("stop", 7)


# ----------------------------------------------------------------- the window, against a real engine worker
LOAD_MS = 120_000  # spawning the worker imports torch + transformers: slow on a busy 2-core machine
REPLY_MS = 60_000


@pytest.fixture
def window(qtbot, tmp_path):
    from app.main_window import MainWindow
    from app.models.history import HistoryStore
    from app.settings import AppSettings
    from resources import DEMO_MODEL_DIR
    from tests.helpers.app_fixtures import Recorder

    win = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"))
    qtbot.addWidget(win)
    win.events = Recorder(win)
    win.show()
    win.start_engine(str(DEMO_MODEL_DIR), "all")
    qtbot.waitUntil(lambda: win.chat.ready or win.banner.isVisible(), timeout=LOAD_MS)
    assert win.chat.ready, win.banner.label.text()
    form = win.chat_view.settings
    form.temperature.setValue(0.0)
    form.max_tokens.setValue(6)  # short replies: the history grows by the user's long turns
    return win


def say(qtbot, win, text: str) -> None:
    """Send `text` and wait for its answer or its refusal."""
    before = len(win.events.of(p.Done)) + len(win.events.of(p.Error))
    win.chat.send(text)
    qtbot.waitUntil(lambda: len(win.events.of(p.Done)) + len(win.events.of(p.Error)) > before, timeout=REPLY_MS)
    qtbot.waitUntil(lambda: not win.chat.streaming, timeout=REPLY_MS)


@pytest.mark.process
def test_the_window_keeps_answering_past_the_context(qtbot, window):
    win, events, view = window, window.events, window.chat_view
    turns = 11
    for i in range(turns):
        say(qtbot, win, f"{i}: {PAD * 3}")
    dones = events.of(p.Done)
    assert len(dones) == turns and not events.of(p.Error)  # every message got a reply
    store, conversation = win.store, win.chat.conversation
    stored = store.messages(conversation.id)
    assert [m.role for m in stored] == ["user", "assistant"] * turns  # nothing deleted from the history
    assert [m.content for m in stored[::2]] == [f"{i}: {PAD * 3}" for i in range(turns)]
    assert sum(m.stats.prefill_tokens for m in stored[1::2]) > 3 * CONTEXT  # three times the context, and more

    # the meter shows what the engine counted: the prompt the model saw, its reply, of the context
    seen = events.of(p.PromptContext)[-1]
    assert seen.request_id == dones[-1].request_id and seen.context_length == CONTEXT and seen.dropped_messages > 0
    assert seen.prompt_tokens == dones[-1].stats.prefill_tokens
    meter = f"{seen.prompt_tokens + len(dones[-1].token_ids):,} / 512 tokens"
    assert view.context_meter.text() == meter and view.context_meter.isVisible()

    # the marker sits right above the first message the model still sees, as the engine counted it
    start = stored[seen.first_message]
    assert start.role == "user" and view.memory_start == start.id and view.memory_marker.isVisible()
    layout = view.messages_layout
    anchor = next(w for w in view.widgets() if w.message_id == start.id)
    assert layout.indexOf(view.memory_marker) == layout.indexOf(anchor) - 1

    # and both come back with the conversation
    win.chat.new_chat()
    assert not view.memory_marker.isVisible() and view.context_meter.text() == "0 / 512 tokens"
    win.chat.open(conversation.id)
    assert view.context_meter.text() == meter and view.memory_start == start.id


@pytest.mark.process
def test_the_window_refuses_a_message_too_long_alone_and_keeps_it(qtbot, window):
    win, events, view = window, window.events, window.chat_view
    say(qtbot, win, "Hello!")
    long = PAD * 12
    say(qtbot, win, long)
    refused = events.of(p.Error)[-1]
    assert refused.kind == "prompt-too-long" and refused.message.startswith("this message is ")
    tokens = int(refused.message.split()[3].replace(",", ""))
    assert tokens > CONTEXT and refused.message.endswith("the model's context is 512 tokens — shorten it")
    assert not [e for e in events.of(p.Token) + events.of(p.Done) if e.request_id == refused.request_id]  # nothing ran
    stored = win.store.messages(win.chat.conversation.id)
    assert [(m.role, m.finish_reason) for m in stored][-1] == ("user", "refused") and stored[-1].content == long
    assert view.composer.edit.toPlainText() == long  # nothing lost: shorten it and send again
    assert "not sent: this message is" in view.widgets()[-1].stats.text()

    view.composer.edit.clear()
    say(qtbot, win, "Hello!")  # not stuck: the refused message is left out of what the model sees
    assert events.of(p.Done)[-1].finish_reason in ("eos", "length") and len(events.of(p.Done)) == 2


@pytest.mark.process
def test_the_stop_policy_says_so_instead_of_dropping(qtbot, window):
    win, events, view = window, window.events, window.chat_view
    form = view.settings
    form.overflow.setCurrentIndex(form.overflow.findData("stop"))
    for i in range(4):
        say(qtbot, win, f"{i}: {PAD * 3}")
    assert win.chat.conversation.context_overflow == "stop"
    assert win.store.conversation(win.chat.conversation.id).context_overflow == "stop"
    errors = events.of(p.Error)
    assert len(errors) == 1 and not events.of(p.PromptContext)[-1].dropped_messages
    assert errors[0].message.startswith("the conversation is ") and "drop its oldest turns" in errors[0].message
    assert not [e for e in events.of(p.Token) if e.request_id == errors[0].request_id]
