"""A strip across the top of the window: what went wrong with the engine, and what to do about it."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from app.themes import LIGHT, Theme
from engine import protocol as p

CRASH_KINDS = ("engine-crashed", "out-of-memory")


def banner_text(error: p.Error) -> str:
    if error.kind == "engine-crashed":
        return f"The engine stopped: {error.message}. Your conversation is safe."
    if error.kind == "out-of-memory":
        return f"Out of memory: {error.message}. Your conversation is safe."
    return error.message


class Banner(QFrame):
    restart_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("banner")
        self.error: p.Error | None = None
        self.theme = LIGHT
        self.label = QLabel("")
        self.label.setWordWrap(True)
        self.restart_button = QPushButton("Restart engine")
        self.restart_button.clicked.connect(self.restart_requested)
        self.dismiss_button = QPushButton("Dismiss")
        self.dismiss_button.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.restart_button)
        layout.addWidget(self.dismiss_button)
        self.hide()

    def show_error(self, error: p.Error) -> None:
        """Crashes and out-of-memory offer Restart; only a dead engine cannot be dismissed."""
        self.error = error
        dead = error.kind == "engine-crashed" or not error.recoverable
        self.label.setText(banner_text(error))
        self.restart_button.setVisible(dead or error.kind in CRASH_KINDS)
        self.dismiss_button.setVisible(not dead)
        self.apply_theme(self.theme)
        self.show()

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        crash = self.error is not None and self.error.kind in CRASH_KINDS
        colour = theme.error_background if crash else theme.warning_background
        self.setStyleSheet(f"#banner {{ background: {colour}; border-radius: 6px; }}")
