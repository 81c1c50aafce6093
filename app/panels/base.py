"""What every panel shares: it takes protocol events, marks itself dirty, and repaints on the frame tick."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QWidget

from app.themes import Theme

pg.setConfigOptions(antialias=True, imageAxisOrder="row-major")


class Panel(QWidget):
    title = ""
    dock_name = ""  # the QDockWidget's objectName: the key saveState remembers the layout under

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.dirty = False

    def on_event(self, event) -> None:
        """Take an event; cheap. Drawing waits for `refresh`."""

    def refresh(self) -> None:
        """Called on every frame tick; draws only when something changed since the last one."""
        if self.dirty:
            self.dirty = False
            self.render()

    def render(self) -> None:
        pass

    def apply_theme(self, theme: Theme) -> None:
        pass


def style_plot(plot: pg.PlotWidget, theme: Theme) -> None:
    plot.setBackground(theme.plot_background)
    for name in ("left", "bottom", "right", "top"):
        axis = plot.getPlotItem().getAxis(name)
        axis.setPen(theme.plot_foreground)
        axis.setTextPen(theme.plot_foreground)


def quiet_plot(plot: pg.PlotWidget) -> None:
    """No mouse panning/zoom or context menu: these plots follow the data, not the user."""
    item = plot.getPlotItem()
    item.setMenuEnabled(False)
    item.hideButtons()
    item.setMouseEnabled(x=False, y=False)


def integer_ticks(n: int, most: int = 16) -> list[tuple[int, str]]:
    """Ticks on whole cells (layers, experts): every one, or every 2nd, 4th… when there are many."""
    step = 1
    while n / step > most:
        step *= 2
    return [(i, str(i)) for i in range(0, n, step)]


def translucent(colour: str, alpha: int = 110) -> QColor:
    c = QColor(colour)
    c.setAlpha(alpha)
    return c
