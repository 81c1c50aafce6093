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
def test_the_window_keeps_answering_past_the_context(qtbot, window, encode):
    win, events, view = window, window.events, window.chat_view
    view.settings.system_prompt.setPlainText("Be brief.")  # kept in every prompt, first of the messages sent
    turns = 9
    for i in range(turns):
        say(qtbot, win, f"{i}: {PAD * 4}")
    dones = events.of(p.Done)
    assert len(dones) == turns and not events.of(p.Error)  # every message got a reply
    store, conversation = win.store, win.chat.conversation
    stored = store.messages(conversation.id)
    assert [m.role for m in stored] == ["user", "assistant"] * turns  # nothing deleted from the history
    assert [m.content for m in stored[::2]] == [f"{i}: {PAD * 4}" for i in range(turns)]
    assert len(encode([{"role": m.role, "content": m.content} for m in stored])) > 3 * CONTEXT

    # the meter shows what the engine counted: the prompt the model saw, its reply, of the context
    seen = events.of(p.PromptContext)[-1]
    assert seen.request_id == dones[-1].request_id and seen.context_length == CONTEXT and seen.dropped_messages > 0
    assert seen.prompt_tokens == dones[-1].stats.prefill_tokens
    meter = f"{seen.prompt_tokens + len(dones[-1].token_ids):,} / 512 tokens"
    assert view.context_meter.text() == meter and view.context_meter.isVisible()

    # the marker sits right above the first message the model still sees, as the engine counted it (its
    # index in the messages sent, the system prompt first)
    start = stored[seen.first_message - 1]
    assert seen.dropped_messages == seen.first_message - 1
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
def test_the_window_refuses_a_message_too_long_alone_and_stop_says_so(qtbot, window):
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

    # "stop" (a new chat takes the setting along): one clear message instead of dropping turns
    win.chat.new_chat()
    form = view.settings
    form.overflow.setCurrentIndex(form.overflow.findData("stop"))
    for i in range(3):
        say(qtbot, win, f"{i}: {PAD * 4}")
    assert win.store.conversation(win.chat.conversation.id).context_overflow == "stop"
    stopped = events.of(p.Error)[-1]
    assert len(events.of(p.Error)) == 2 and not events.of(p.PromptContext)[-1].dropped_messages
    assert stopped.message.startswith("the conversation is ") and "drop its oldest turns" in stopped.message
    assert not [e for e in events.of(p.Token) if e.request_id == stopped.request_id]


# ----------------------------------------------------------------- moescope chat, reading stdin
def moescope_chat(lines: list[str], *, end: str = "") -> tuple[int, str, str]:
    """`moescope chat` on the demo model, greedy with short replies, fed `lines` (and `end` after them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "chat", "--model", "demo", "--temperature", "0",
                          "--max-new-tokens", "6"], input="\n".join(lines) + "\n" + end, capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    return out.returncode, out.stdout, out.stderr


@pytest.mark.process
def test_moescope_chat_keeps_going_refuses_a_long_message_and_ends_on_exit():
    turns = 9  # 3x the context: 9 turns of about 200 tokens
    long = PAD * 12
    lines = [f"{i}: {PAD * 4}" for i in range(turns)] + [long, "Hello!", "/context stop", "Hello again!", "/exit",
                                                          "never sent"]
    code, out, err = moescope_chat(lines)
    assert code == 0, err
    meters = [line for line in err.splitlines() if line.startswith("[") and "context" in line]
    assert len(meters) == turns + 1  # every message got a reply but the one too long
    used = [int(line.split("context ")[1].split(" /")[0].replace(",", "")) for line in meters]
    assert all(line.endswith(" / 512 tokens]") for line in meters) and max(used) <= CONTEXT
    dropped = [line for line in err.splitlines() if "the model no longer sees the" in line]
    assert dropped and dropped[0].endswith("oldest messages: they outgrew its 512-token context")
    refusals = [line for line in err.splitlines() if line.startswith("moescope: this message is ")]
    assert len(refusals) == 1 and refusals[0].endswith("the model's context is 512 tokens — shorten it")
    assert "moescope: the conversation is " in err and "/context drop-oldest lets the chat go on" in err
    assert "longer than the specified maximum" not in err  # measuring a long history is not a warning
    assert out.count("> ") == len(lines) - 1  # read up to /exit, and not past it


@pytest.mark.process
def test_moescope_chat_ends_on_ctrl_d(monkeypatch, capsys):
    import io

    from engine.cli.main import main as moescope_cli

    monkeypatch.setattr("sys.stdin", io.StringIO("/help\nHello!\n"))  # then the end of the input, as Ctrl-D
    assert moescope_cli(["chat", "--model", "demo", "--temperature", "0", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert "/exit or /quit (or Ctrl-D) ends the chat" in err and "context " in err.splitlines()[-1]
    assert out.count("> ") == 3  # /help, Hello!, then the end of the input
