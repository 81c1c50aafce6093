"""The chat's behaviour: conversations in the history store, requests to the engine, replies streaming back.

Streamed text is drawn on the frame tick and written to SQLite at most twice a second, so a crash
loses at most the unfinished reply's last half-second, and a fast model never floods the disk.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat.chat_view import ChatView
from app.chat.message_widget import MessageWidget
from app.engine_bridge import EngineBridge
from app.models.context_meter import tokens_in_context
from app.models.history import DEFAULT_OVERFLOW, DEFAULT_TITLE, Conversation, HistoryStore, Message
from engine import protocol as p

SAVE_INTERVAL_MS = 500
TITLE_LENGTH = 48


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return (line[: TITLE_LENGTH - 1] + "…") if len(line) > TITLE_LENGTH else (line or DEFAULT_TITLE)


@dataclass
class ActiveReply:
    request_id: str
    conversation_id: int
    message_id: int
    text: str = ""
    draft: str = ""  # a block-diffusion model's block being denoised, shown after the text
    unsaved: bool = False
    sent_ids: tuple[int | None, ...] = ()  # the message id of each turn sent (None: the system prompt)


class ChatController(QObject):
    conversations_changed = Signal()
    streaming_changed = Signal(bool)
    reply_finished = Signal(object)  # the Done event (also for cancelled replies)
    notice = Signal(str)  # a one-line message for the status bar

    def __init__(self, store: HistoryStore, bridge: EngineBridge, view: ChatView, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.bridge, self.view = store, bridge, view
        self.conversation: Conversation | None = None
        self.active: ActiveReply | None = None
        self.ready = False  # a model is loaded
        self.model_name = ""
        self.context_length = 0  # the loaded model's, for the context meter
        self.queued: str | None = None  # sent before the model finished loading
        self._next_render = 0.0
        self.draft_system_prompt = ""
        self.draft_sampling = p.SamplingSettings()
        self.draft_overflow = DEFAULT_OVERFLOW
        self._save_timer = QTimer(self, interval=SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self.save_partial)

        view.composer.send_requested.connect(self.send)
        view.composer.stop_requested.connect(self.stop)
        view.settings.changed.connect(self.update_settings)
        view.settings.overflow_changed.connect(self.set_context_overflow)
        view.settings.load(self.draft_system_prompt, self.draft_sampling, self.draft_overflow)

    # ----- conversations -----
    @property
    def streaming(self) -> bool:
        return self.active is not None

    def new_chat(self) -> None:
        """An empty chat; it is stored on its first message, so empty chats do not pile up."""
        if self.conversation is not None:
            self.draft_system_prompt = self.conversation.system_prompt
            self.draft_sampling = self.conversation.sampling
            self.draft_overflow = self.conversation.context_overflow
        self.conversation = None
        self.view.clear()
        self.view.title.setText(DEFAULT_TITLE)
        self.view.settings.load(self.draft_system_prompt, self.draft_sampling, self.draft_overflow)
        self._refresh_meter()
        self.conversations_changed.emit()

    def open(self, conversation_id: int) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return
        self.conversation = conversation
        self.view.clear()
        self.view.title.setText(conversation.title)
        self.view.settings.load(conversation.system_prompt, conversation.sampling, conversation.context_overflow)
        for m in self.store.messages(conversation_id):
            widget = self._add_widget(m)
            if self.active and m.id == self.active.message_id:
                widget.set_text(self.active.text)
                widget.set_streaming(True)
        self.view.set_memory_start(conversation.memory_start)
        self._refresh_meter()
        self._refresh_actions()
        self.view.scroll_to_bottom()
        self.conversations_changed.emit()

    def rename(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        if self.conversation and self.conversation.id == conversation_id:
            self.conversation = self.store.conversation(conversation_id)
            self.view.title.setText(self.conversation.title if self.conversation else DEFAULT_TITLE)
        self.conversations_changed.emit()

    def delete(self, conversation_id: int) -> None:
        if self.active and self.active.conversation_id == conversation_id:
            self.stop()
            self.active = None
            self._set_streaming(False)
        self.store.delete_conversation(conversation_id)
        if self.conversation and self.conversation.id == conversation_id:
            self.conversation = None
            self.view.clear()
            self.view.title.setText(DEFAULT_TITLE)
        self.conversations_changed.emit()

    def update_settings(self, system_prompt: str, sampling: p.SamplingSettings) -> None:
        if self.conversation is None:
            self.draft_system_prompt, self.draft_sampling = system_prompt, sampling
            return
        self.store.update_settings(self.conversation.id, system_prompt, sampling)
        self.conversation = replace(self.conversation, system_prompt=system_prompt, sampling=sampling)

    def set_context_overflow(self, overflow: str) -> None:
        """What the engine does when this conversation outgrows the context (protocol.CONTEXT_OVERFLOW)."""
        if self.conversation is None:
            self.draft_overflow = overflow
            return
        self.store.set_context_overflow(self.conversation.id, overflow)
        self.conversation = replace(self.conversation, context_overflow=overflow)

    # ----- sending -----
    def send(self, text: str) -> None:
        if self.streaming or not text.strip():
            return
        if not self.ready:
            if self.bridge.crashed:
                self.notice.emit("The engine is not running; restart it first.")
                self.view.composer.edit.setPlainText(text)
                return
            self.queued = text  # sent as soon as the model is loaded
            self.notice.emit("The model is still loading; your message will be sent when it is ready.")
            return
        if self.conversation is None:
            self.conversation = self.store.create_conversation(
                title_from(text), self.draft_system_prompt, self.draft_sampling, self.model_name, self.draft_overflow
            )
            self.view.title.setText(self.conversation.title)
        message = self.store.add_message(self.conversation.id, "user", text)
        self._add_widget(message)
        self.view.scroll_to_bottom()
        self._start_reply()
        self.conversations_changed.emit()

    def regenerate(self, message_id: int) -> None:
        """Replace the reply `message_id` (the last one) with a new one."""
        if self.streaming or self.conversation is None or not self.ready:
            return
        self.store.delete_messages_from(self.conversation.id, message_id)
        self.view.remove_from(message_id)
        self._start_reply()

    def edit_and_resend(self, message_id: int, text: str) -> None:
        """Change a user message, drop everything after it, and ask again."""
        if self.streaming or self.conversation is None or not self.ready:
            return
        self.store.update_message(message_id, text)
        following = [m.id for m in self.store.messages(self.conversation.id) if m.id > message_id]
        if following:
            self.store.delete_messages_from(self.conversation.id, following[0])
            self.view.remove_from(following[0])
        for w in self.view.widgets():
            if w.message_id == message_id:
                w.set_text(text)
                w.render()
        self._start_reply()

    def stop(self) -> None:
        if self.active is not None:
            self.bridge.send(p.Cancel(self.active.request_id))

    def history_for_engine(self) -> list[dict]:
        return self._history_with_ids()[0]

    def _history_with_ids(self) -> tuple[list[dict], list[int | None]]:
        """The turns to send, and the message id of each (None for the system prompt), so that the engine's
        "first message seen" maps back onto the chat. Failed replies and refused messages are left out."""
        assert self.conversation is not None
        turns = [{"role": "system", "content": self.conversation.system_prompt}] if self.conversation.system_prompt else []
        ids: list[int | None] = [None] * len(turns)
        for m in self.store.messages(self.conversation.id):
            if m.role in ("user", "assistant") and m.content and m.finish_reason not in ("error", "refused"):
                turns.append({"role": m.role, "content": m.content})
                ids.append(m.id)
        return turns, ids

    def _start_reply(self) -> None:
        assert self.conversation is not None
        turns, sent_ids = self._history_with_ids()
        reply = self.store.add_message(self.conversation.id, "assistant", "")
        request_id = uuid.uuid4().hex[:12]
        self.active = ActiveReply(request_id, self.conversation.id, reply.id, sent_ids=tuple(sent_ids))
        widget = self._add_widget(reply)
        widget.set_streaming(True)
        self._set_streaming(True)
        self._save_timer.start()
        self.bridge.send(p.Generate(request_id, messages=turns, sampling=self.conversation.sampling,
                                    context_overflow=self.conversation.context_overflow))

    # ----- engine events -----
    def on_event(self, event) -> None:
        if isinstance(event, p.ModelLoaded):
            self.ready = True
            self.model_name = event.name
            self.context_length = event.context_length
            self._refresh_meter()
            self.view.offer_examples(event.path)  # the demo's skills as prompts to click
            if self.queued is not None:
                text, self.queued = self.queued, None
                self.send(text)
        elif isinstance(event, p.PromptContext):
            if self.active and event.request_id == self.active.request_id:
                self._prompt_context(event)
        elif isinstance(event, p.Token):
            if self.active and event.request_id == self.active.request_id:
                self.active.text += event.text  # drawn on the next frame tick
                self.active.draft = ""  # the block is done
                self.active.unsaved = True
        elif isinstance(event, p.Draft):
            if self.active and event.request_id == self.active.request_id:
                self.active.draft = event.text
        elif isinstance(event, p.Done):
            if self.active and event.request_id == self.active.request_id:
                self._finish(event.text, event.stats, event.finish_reason)
                self._refresh_meter()
                self.reply_finished.emit(event)
        elif isinstance(event, p.Error):
            self._error(event)

    def _error(self, event: p.Error) -> None:
        if event.kind == "engine-crashed" or not event.recoverable:
            self.ready = False
        if self.active is None:
            return
        if event.kind == "prompt-too-long" and event.request_id == self.active.request_id and not self.active.text:
            self._refused(event.message)
            return
        if event.kind == "engine-crashed" or event.request_id in (None, self.active.request_id):
            widget = self.active_widget()
            self._finish(self.active.text, None, "error")
            if widget is not None:
                widget.set_error(event.message)

    def _prompt_context(self, event: p.PromptContext) -> None:
        """The engine fitted the history into the context: mark where the model's memory starts now (kept
        with the conversation) and show how full the context is."""
        active = self.active
        assert active is not None
        self.context_length = event.context_length
        start = None
        if event.dropped_messages and 0 <= event.first_message < len(active.sent_ids):
            start = active.sent_ids[event.first_message]
        self.store.set_memory_start(active.conversation_id, start)
        if self.conversation is not None and self.conversation.id == active.conversation_id:
            self.conversation = replace(self.conversation, memory_start=start)
            self.view.set_memory_start(start)
            self._refresh_meter(event.prompt_tokens)

    def _refused(self, message: str) -> None:
        """The engine refused the prompt before generating (a message longer than the context, or a full
        context under "stop"): no empty reply stays; the user's message stays in the history, marked not
        sent and left out of later prompts, and its text goes back into an empty composer to shorten."""
        active = self.active
        assert active is not None
        self.active = None
        self._save_timer.stop()
        self.store.delete_messages_from(active.conversation_id, active.message_id)
        self.view.remove_from(active.message_id)
        asked = next((m for m in reversed(self.store.messages(active.conversation_id)) if m.role == "user"), None)
        if asked is not None:
            self.store.update_message(asked.id, asked.content, None, "refused")
            widget = self._widget(asked.id)
            if widget is not None:
                widget.set_error(message, "not sent")
                if not self.view.composer.edit.toPlainText().strip():
                    self.view.composer.edit.setPlainText(asked.content)
        self.notice.emit(message)
        self._set_streaming(False)

    def _refresh_meter(self, used: int | None = None) -> None:
        """The context meter of the conversation shown: `used` tokens, else what its last reply left."""
        if used is None:
            messages = self.store.messages(self.conversation.id) if self.conversation is not None else []
            last = next((m for m in reversed(messages) if m.role == "assistant" and m.stats is not None), None)
            used = tokens_in_context(last.stats if last is not None else None)
        self.view.set_context(used, self.context_length)

    def _finish(self, text: str, stats: p.ReplyStats | None, finish_reason: str) -> None:
        active = self.active
        assert active is not None
        self.active = None
        self._save_timer.stop()
        self.store.update_message(active.message_id, text, stats, finish_reason)
        self.store.touch(active.conversation_id)
        widget = self._widget(active.message_id)
        if widget is not None:
            widget.set_text(text)
            widget.set_streaming(False)
            widget.set_stats(stats, finish_reason)
        self._set_streaming(False)
        self._refresh_actions()

    def save_partial(self) -> None:
        """At most every SAVE_INTERVAL_MS while streaming: the reply so far."""
        if self.active and self.active.unsaved:
            self.store.update_message(self.active.message_id, self.active.text, None, None)
            self.active.unsaved = False

    def refresh(self) -> None:
        """Frame tick: draw the streaming reply if it grew.

        Markdown + highlighting of a long reply costs tens of milliseconds, so redraws are spaced
        to keep that under a quarter of the GUI thread's time; the final text is drawn on Done.
        """
        now = time.monotonic()
        if now < self._next_render:
            return
        widget = self.active_widget()
        if widget is not None and (widget.text, widget.draft) != (self.active.text, self.active.draft):
            widget.set_text(self.active.text)
            widget.set_draft(self.active.draft)
            started = time.perf_counter()
            widget.render()
            self._next_render = now + 3 * (time.perf_counter() - started)

    # ----- widgets -----
    def active_widget(self) -> MessageWidget | None:
        return self._widget(self.active.message_id) if self.active else None

    def _widget(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.view.widgets() if w.message_id == message_id), None)

    def _add_widget(self, m: Message) -> MessageWidget:
        widget = MessageWidget(m.id, m.role, m.content)
        unfinished = m.role == "assistant" and m.finish_reason is None and not (self.active and self.active.message_id == m.id)
        widget.set_stats(m.stats, "interrupted" if unfinished and m.content else m.finish_reason)
        widget.edit_submitted.connect(self.edit_and_resend)
        widget.regenerate_requested.connect(self.regenerate)
        widget.copy_done.connect(lambda: self.notice.emit("Copied to the clipboard"))
        return self.view.add(widget)

    def _refresh_actions(self) -> None:
        widgets = self.view.widgets()
        for i, w in enumerate(widgets):
            w.set_actions_enabled(not self.streaming)
            w.set_can_regenerate(i == len(widgets) - 1)

    def _set_streaming(self, streaming: bool) -> None:
        self.view.composer.set_streaming(streaming)
        self._refresh_actions()
        self.streaming_changed.emit(streaming)
