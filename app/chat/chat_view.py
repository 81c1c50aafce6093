"""The centre of the window: the conversation's messages, its settings, and the composer."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.composer import Composer
from app.chat.examples import ExamplePrompts, demo_offer
from app.chat.message_widget import MessageWidget
from app.chat.settings_form import ConversationSettingsForm
from app.elided_label import ElidedLabel
from app.models.context_meter import MEMORY_MARKER, meter_text, meter_tip
from app.themes import LIGHT, Theme


class ChatView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = LIGHT
        self.title = ElidedLabel("New chat")
        self.title.setObjectName("chat-title")
        self.title.setStyleSheet("font-size: 14pt; font-weight: 600;")
        self.settings_toggle = QToolButton()
        self.settings_toggle.setText("Conversation settings")
        self.settings_toggle.setCheckable(True)
        self.settings_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.settings_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.settings_toggle.toggled.connect(self._toggle_settings)
        self.settings = ConversationSettingsForm()
        self.settings.setVisible(False)
        self.context_meter = QLabel("")  # how full the model's context is, after each reply
        self.context_meter.setObjectName("context-meter")
        self.context_meter.setVisible(False)
        # above the first message the model still sees, when older turns no longer fit its context
        self.memory_marker = QLabel(f"— {MEMORY_MARKER} —")
        self.memory_marker.setObjectName("memory-marker")
        self.memory_marker.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.memory_marker.setWordWrap(True)
        self.memory_marker.setVisible(False)
        self.memory_start: int | None = None  # the message id the marker sits above

        self.messages_box = QWidget()
        self.messages_layout = QVBoxLayout(self.messages_box)
        self.messages_layout.setContentsMargins(8, 8, 8, 8)
        self.messages_layout.setSpacing(8)
        self.empty_hint = QLabel("Ask the model anything. Watch the panels: every token routes through the expert cache.")
        self.empty_hint.setWordWrap(True)
        self.empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.messages_layout.addWidget(self.empty_hint)
        self.examples = ExamplePrompts()  # the demo model's skills, on an empty chat
        self.messages_layout.addWidget(self.examples)
        self.messages_layout.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setWidget(self.messages_box)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        bar = self.scroll.verticalScrollBar()
        self._follow = True  # stick to the bottom while a reply streams, unless the user scrolled up
        bar.valueChanged.connect(lambda v: setattr(self, "_follow", v >= bar.maximum() - 8))
        bar.rangeChanged.connect(lambda _lo, hi: bar.setValue(hi) if self._follow else None)

        self.composer = Composer()
        self.examples.picked.connect(self.composer.send_requested)  # sent as if typed

        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(self.context_meter)
        head.addWidget(self.settings_toggle)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addLayout(head)
        layout.addWidget(self.settings)
        layout.addWidget(self.scroll, 1)
        layout.addWidget(self.composer)

    def _toggle_settings(self, shown: bool) -> None:
        self.settings.setVisible(shown)
        self.settings_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    # ----- messages -----
    def widgets(self) -> list[MessageWidget]:
        items = (self.messages_layout.itemAt(i).widget() for i in range(self.messages_layout.count()))
        return [w for w in items if isinstance(w, MessageWidget)]

    def clear(self) -> None:
        for w in self.widgets():
            self.messages_layout.removeWidget(w)
            w.deleteLater()
        self.set_memory_start(None)
        self._show_empty(True)
        self._follow = True

    def add(self, widget: MessageWidget) -> MessageWidget:
        widget.apply_theme(self.theme)
        self.messages_layout.insertWidget(self.messages_layout.count() - 1, widget)  # above the stretch
        self._show_empty(False)
        return widget

    def remove_from(self, message_id: int) -> None:
        """Remove `message_id` and every message after it."""
        for w in self.widgets():
            if w.message_id >= message_id:
                self.messages_layout.removeWidget(w)
                w.deleteLater()
        if self.memory_start is not None and self.memory_start >= message_id:
            self.set_memory_start(None)
        self._show_empty(not self.widgets())

    def offer_examples(self, model_path: str) -> None:
        """The loaded model's example prompts under an empty chat: the demo's skills, none for other models."""
        self.examples.offer(demo_offer(model_path))
        self._show_empty(not self.widgets())

    def _show_empty(self, empty: bool) -> None:
        # the demo's examples say what it can be asked; any other model gets the general hint
        self.examples.setVisible(empty and self.examples.offered)
        self.empty_hint.setVisible(empty and not self.examples.offered)

    def set_memory_start(self, message_id: int | None) -> None:
        """Put the marker above `message_id` (None, or a message not shown: no marker)."""
        self.messages_layout.removeWidget(self.memory_marker)
        anchor = next((w for w in self.widgets() if w.message_id == message_id), None)
        self.memory_start = message_id if anchor is not None else None
        self.memory_marker.setVisible(anchor is not None)
        if anchor is not None:
            self.messages_layout.insertWidget(self.messages_layout.indexOf(anchor), self.memory_marker)

    def set_context(self, used: int, context_length: int) -> None:
        """The meter: tokens the conversation fills of the model's context (hidden before a model loads)."""
        self.context_meter.setText(meter_text(used, context_length))
        self.context_meter.setToolTip(meter_tip(used, context_length, self.memory_start is not None))
        self.context_meter.setVisible(context_length > 0 or used > 0)

    def scroll_to_bottom(self) -> None:
        self._follow = True
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.empty_hint.setStyleSheet(f"color: {theme.muted};")
        self.examples.about.setStyleSheet(f"color: {theme.muted};")
        self.context_meter.setStyleSheet(f"color: {theme.muted};")
        self.memory_marker.setStyleSheet(f"color: {theme.muted}; font-style: italic;")
        for w in self.widgets():
            w.apply_theme(theme)
