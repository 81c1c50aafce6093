"""A uint8 mask drawn in one colour over a rectangle, as a premultiplied ARGB image.

pyqtgraph's ImageItem would hand Qt an indexed image with a colour table, which Qt converts to
ARGB on every paint; for an overlay about the size of the plot that conversion is most of the
frame. Building the premultiplied pixels once per change (one numpy multiply) makes each paint
a plain blend.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QRectF
from PySide6.QtGui import QColor, QImage, QPainter
from PySide6.QtWidgets import QGraphicsObject


def premultiplied(colour: QColor, alpha: int) -> np.uint32:
    a = alpha / 255.0
    r, g, b = (round(c * a) for c in (colour.red(), colour.green(), colour.blue()))
    return np.uint32((alpha << 24) | (r << 16) | (g << 8) | b)


class MaskOverlay(QGraphicsObject):
    def __init__(self) -> None:
        super().__init__()
        self._rect = QRectF()
        self._pixels: np.ndarray | None = None  # keeps the QImage's memory alive
        self._image: QImage | None = None
        self._colour = np.uint32(0xFF00C8FF)

    def set_colour(self, colour: QColor, alpha: int = 255) -> None:
        self._colour = premultiplied(colour, alpha)

    def set_rect(self, rect: QRectF) -> None:
        self.prepareGeometryChange()
        self._rect = QRectF(rect)

    def set_mask(self, mask: np.ndarray) -> None:
        """mask: [h, w] uint8 of 0/1, row 0 at the rectangle's top."""
        pixels = np.multiply(mask, self._colour, dtype=np.uint32)
        h, w = pixels.shape
        self._pixels = pixels
        self._image = QImage(pixels.data, w, h, 4 * w, QImage.Format.Format_ARGB32_Premultiplied)
        self.update()

    def boundingRect(self) -> QRectF:
        return self._rect

    def paint(self, painter: QPainter, _option, _widget=None) -> None:
        if self._image is not None:
            painter.drawImage(self._rect, self._image)
