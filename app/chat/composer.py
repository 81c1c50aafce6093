"""Where the user types: Enter sends, Shift+Enter is a new line; the button is Send or Stop."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QPushButton, QWidget


class MessageEdit(QPlainTextEdit):
    submit = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submit.emit()
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    send_requested = Signal(str)
    stop_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.streaming = False
        self.edit = MessageEdit()
        self.edit.setPlaceholderText("Message the model — Enter sends, Shift+Enter for a new line, Esc stops")
        self.edit.setFixedHeight(72)
        self.edit.submit.connect(self._submit)
        self.button = QPushButton("Send")
        self.button.setMinimumWidth(80)
        self.button.clicked.connect(self._clicked)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.edit, 1)
        layout.addWidget(self.button)

    def set_streaming(self, streaming: bool) -> None:
        self.streaming = streaming
        self.button.setText("Stop" if streaming else "Send")
        self.button.setToolTip("Stop the reply (Esc)" if streaming else "Send (Enter)")

    def _clicked(self) -> None:
        if self.streaming:
            self.stop_requested.emit()
        else:
            self._submit()

    def _submit(self) -> None:
        text = self.edit.toPlainText()
        if self.streaming or not text.strip():
            return
        self.edit.clear()
        self.send_requested.emit(text)
