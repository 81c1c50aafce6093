"""A QTextBrowser that grows to fit its document, for messages stacked in one scroll area."""

from __future__ import annotations

import math

from PySide6.QtCore import QSizeF, Qt
from PySide6.QtGui import QTextOption
from PySide6.QtWidgets import QFrame, QSizePolicy, QTextBrowser, QWidget


class AutoHeightBrowser(QTextBrowser):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)  # the message's own background shows through
        self.document().setDocumentMargin(2)
        # Model output can hold long unbroken runs (URLs, hashes, noise): wrap them too, never widen.
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit(self.document().size())

    def _fit(self, size: QSizeF) -> None:
        margins = self.contentsMargins()
        self.setFixedHeight(math.ceil(size.height()) + margins.top() + margins.bottom() + 2 * self.frameWidth())
