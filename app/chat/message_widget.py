"""One message in the chat: Markdown body, the reply's statistics, and its actions."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.rich_text import AutoHeightBrowser
from app.models.markdown_render import render_markdown, stylesheet
from app.models.stats_format import reply_stats_line
from app.themes import LIGHT, Theme
from engine.protocol import ReplyStats

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
FINISH_NOTES = {"cancelled": "stopped", "length": "reached max tokens", "error": "failed",
                "interrupted": "interrupted (the app closed while it streamed)",
                "refused": "not sent: too long for the model's context"}  # a user message the engine refused


class MessageWidget(QFrame):
    copy_done = Signal()
    edit_submitted = Signal(int, str)  # message id, new text
    regenerate_requested = Signal(int)  # message id

    def __init__(self, message_id: int, role: str, text: str = "", theme: Theme = LIGHT,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message_id, self.role, self.text = message_id, role, text
        self.theme = theme
        self.streaming = False
        self.draft = ""
        self._rendered: tuple[str, str] | None = None
        self.setObjectName(f"message-{role}")
        self.setFrameShape(QFrame.Shape.NoFrame)

        self.who = QLabel(ROLE_NAMES.get(role, role))
        self.who.setStyleSheet("font-weight: 600;")
        self.body = AutoHeightBrowser()
        self.stats = QLabel("")
        self.stats.setObjectName("reply-stats")
        self.stats.setWordWrap(True)  # never wider than the chat
        self.stats.setVisible(False)
        self.stats.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.copy_button = self._tool("Copy", "Copy this message as Markdown", self.copy)
        self.edit_button = self._tool("Edit", "Edit this message and send it again", self.begin_edit)
        self.regen_button = self._tool("Regenerate", "Ask for this reply again",
                                       lambda: self.regenerate_requested.emit(self.message_id))
        self.edit_button.setVisible(role == "user")
        self.regen_button.setVisible(False)

        self.editor = QPlainTextEdit()
        self.editor.setVisible(False)
        self.save_button = QPushButton("Save && send")
        self.cancel_button = QPushButton("Cancel")
        self.save_button.clicked.connect(self._submit_edit)
        self.cancel_button.clicked.connect(self.end_edit)
        self.edit_row = QWidget()
        row = QHBoxLayout(self.edit_row)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        row.addWidget(self.cancel_button)
        row.addWidget(self.save_button)
        self.edit_row.setVisible(False)

        header = QHBoxLayout()
        header.addWidget(self.who)
        header.addStretch(1)
        for b in (self.copy_button, self.edit_button, self.regen_button):
            header.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        layout.setSpacing(2)
        layout.addLayout(header)
        layout.addWidget(self.body)
        layout.addWidget(self.editor)
        layout.addWidget(self.edit_row)
        layout.addWidget(self.stats)
        self.apply_theme(theme)
        self.render()

    def _tool(self, text: str, tip: str, slot) -> QToolButton:
        button = QToolButton()
        button.setText(text)
        button.setToolTip(tip)
        button.setAutoRaise(True)
        button.clicked.connect(slot)
        return button

    # ----- content -----
    def set_text(self, text: str) -> None:
        """Store only; `render` (on the frame tick while streaming) draws it."""
        self.text = text

    def append(self, delta: str) -> None:
        self.text += delta

    def set_draft(self, draft: str) -> None:
        """A block being denoised (block-diffusion models), drawn muted after the text while streaming."""
        self.draft = draft

    def render(self) -> None:
        if self._rendered == (self.text, self.draft):
            return
        self._rendered = (self.text, self.draft)
        draft = self.draft if self.streaming else ""
        shown = self.text + (" ▍" if self.streaming and not draft else "")
        if not shown.strip() and not draft:
            self.body.setHtml(f"<i style='color:{self.theme.muted}'>…</i>")
            return
        html = render_markdown(shown, self.theme.code_style) if shown.strip() else ""
        if draft:
            html += f"<p style='color:{self.theme.muted}'><i>{escape(draft)}</i> ▍</p>"
        self.body.setHtml(html)

    def set_streaming(self, streaming: bool) -> None:
        self.streaming = streaming
        self._rendered = None
        self.render()
        self.copy_button.setEnabled(not streaming)

    def set_stats(self, stats: ReplyStats | None, finish_reason: str | None = None) -> None:
        parts = []
        if stats:
            parts.append(reply_stats_line(stats))
        if finish_reason in FINISH_NOTES:
            parts.append(FINISH_NOTES[finish_reason])
        self.stats.setText(" · ".join(parts))
        self.stats.setVisible(bool(parts))

    def set_error(self, message: str, what: str = "failed") -> None:
        self.stats.setText(f"⚠ {what}: {message}")
        self.stats.setVisible(True)

    def set_can_regenerate(self, allowed: bool) -> None:
        self.regen_button.setVisible(self.role == "assistant" and allowed)

    def set_actions_enabled(self, enabled: bool) -> None:
        """No edits or regeneration while a reply streams."""
        self.edit_button.setEnabled(enabled)
        self.regen_button.setEnabled(enabled)

    # ----- actions -----
    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text)
        self.copy_done.emit()

    def begin_edit(self) -> None:
        self.editor.setPlainText(self.text)
        self.body.setVisible(False)
        self.editor.setVisible(True)
        self.edit_row.setVisible(True)
        self.editor.setFocus()

    def end_edit(self) -> None:
        self.editor.setVisible(False)
        self.edit_row.setVisible(False)
        self.body.setVisible(True)

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText()
        if text.strip():
            self.end_edit()
            self.edit_submitted.emit(self.message_id, text)

    # ----- look -----
    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        background = theme.user_bubble if self.role == "user" else theme.base
        self.setStyleSheet(f"#message-{self.role} {{ background: {background}; border-radius: 8px; }}")
        self.body.document().setDefaultStyleSheet(
            stylesheet(theme.text, theme.code_background, theme.accent, theme.border)
        )
        self.stats.setStyleSheet(f"color: {theme.muted};")
        self._rendered = None
        self.render()
