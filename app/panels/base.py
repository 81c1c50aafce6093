"""What every panel shares: it takes protocol events, marks itself dirty, and repaints on the frame tick."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QFormLayout, QLabel, QWidget

from app.themes import Theme

pg.setConfigOptions(antialias=True, imageAxisOrder="row-major")


class Panel(QWidget):
    title = ""
    dock_name = ""  # the QDockWidget's objectName: the key saveState remembers the layout under
    local_only = False  # shows MoEScope's own cache: does not apply when the engine is a remote server

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.dirty = False
        self.remote_notice: QLabel | None = None

    def show_remote(self, url: str) -> None:
        """A local-only panel says plainly that it does not apply to a remote server ("": the local engine)."""
        if not self.local_only:
            return
        if self.remote_notice is None:
            self.remote_notice = QLabel()
            self.remote_notice.setObjectName("remote-notice")
            self.remote_notice.setWordWrap(True)
            self.remote_notice.setAlignment(Qt.AlignmentFlag.AlignCenter)
            layout = self.layout()
            if isinstance(layout, QFormLayout):
                layout.insertRow(0, self.remote_notice)
            else:
                layout.insertWidget(0, self.remote_notice)
        self.remote_notice.setText(f"{self.title} does not apply to a remote engine: the server at {url} runs "
                                   "its own memory, and MoEScope's cache is not in between." if url else "")
        for child in self.findChildren(QWidget, options=Qt.FindChildOption.FindDirectChildrenOnly):
            child.setVisible(child is self.remote_notice if url else child is not self.remote_notice)

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
