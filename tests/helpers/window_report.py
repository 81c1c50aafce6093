"""Reading what `moescope --screenshot` leaves: its JSON line on stdout and the saved window."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def screenshot_report(stdout: str) -> dict:
    """The JSON line screenshot mode prints last on stdout (app/screenshot.py)."""
    lines = stdout.strip().splitlines()
    assert lines, "screenshot mode printed no report"
    return json.loads(lines[-1])


def png_pixels(path: Path) -> np.ndarray:
    """The PNG as an (height, width, 3) uint8 RGB array, read with Qt."""
    from PySide6.QtGui import QImage

    image = QImage(str(path)).convertToFormat(QImage.Format.Format_RGB888)
    assert not image.isNull(), path
    rows = np.frombuffer(image.constBits(), np.uint8).reshape(image.height(), image.bytesPerLine())
    return rows[:, : image.width() * 3].reshape(image.height(), image.width(), 3).copy()


def assert_heatmap_drawn(png: Path, report: dict) -> None:
    """The heatmap's cells in the saved window are painted with its colour map, its brightest colour
    included (the most-used expert of the reply): an empty or undrawn plot is one background colour."""
    from app.panels.heatmap import _lut

    assert report["heatmap_renders"] >= 1
    x, y, w, h = report["heatmap_cells"]
    assert w >= 50 and h >= 50, report["heatmap_cells"]
    cells = png_pixels(png)[y: y + h, x: x + w].reshape(-1, 3).astype(np.int16)
    lut = _lut().astype(np.int16)
    nearest = np.abs(cells[:, None, :] - lut[None, :, :]).max(axis=2).min(axis=1)
    assert (nearest <= 8).mean() > 0.6, "the heatmap area is not painted with its colour map"
    brightest = (np.abs(cells - lut[-1]).max(axis=1) <= 8).mean()
    assert brightest > 0.005, "no cell at the brightest colour: the reply's routing was not drawn"
    assert len(np.unique(cells, axis=0)) >= 4
