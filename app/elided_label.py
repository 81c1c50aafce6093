"""A one-line label that never widens its parent: text too long for its width ends in "…", and the
full text is in the tooltip. `text()` is always the full text."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QWidget


class ElidedLabel(QLabel):
    def __init__(self, text: str = "", parent: QWidget | None = None, *, min_chars: int = 6,
                 mode: Qt.TextElideMode = Qt.TextElideMode.ElideRight) -> None:
        super().__init__(text, parent)
        self.min_chars = min_chars  # how narrow a layout may make it, in average characters
        self.mode = mode
        self._tip = ""  # the tooltip its owner set: kept under the full text when elided
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setWordWrap(False)
        self._update_tip()

    # ----- text and tooltip -----
    def setText(self, text: str) -> None:
        super().setText(text)
        self._update_tip()
        self.update()

    def setToolTip(self, tip: str) -> None:
        self._tip = tip
        self._update_tip()

    def elided(self) -> bool:
        return self.fontMetrics().horizontalAdvance(self.text()) > self.contentsRect().width()

    def shown_text(self) -> str:
        """What the label paints now."""
        return self.fontMetrics().elidedText(self.text(), self.mode, self.contentsRect().width())

    def _update_tip(self) -> None:
        tip = "\n\n".join(part for part in (self.text(), self._tip) if part) if self.elided() else self._tip
        super().setToolTip(tip)

    # ----- size -----
    def minimumSizeHint(self) -> QSize:
        metrics = self.fontMetrics()
        margins = self.contentsMargins()
        width = metrics.averageCharWidth() * self.min_chars + margins.left() + margins.right()
        return QSize(width, metrics.height() + margins.top() + margins.bottom())

    def sizeHint(self) -> QSize:
        """Room for the whole text where there is room; the minimum is what a layout may squeeze it to."""
        hint = self.minimumSizeHint()
        margins = self.contentsMargins()
        full = self.fontMetrics().horizontalAdvance(self.text()) + margins.left() + margins.right()
        return QSize(max(hint.width(), full), hint.height())

    # ----- drawing -----
    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._update_tip()

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):  # a theme: other metrics
            self._update_tip()

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        self.style().drawItemText(painter, self.contentsRect(), int(self.alignment()), self.palette(),
                                  self.isEnabled(), self.shown_text(), self.foregroundRole())
        painter.end()
