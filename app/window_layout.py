"""The window's layout rule. The window opens within the screen's available area, never bigger. The
panels beside the chat take two columns where that area is wide (WIDE_FROM device-independent pixels,
so 150 % scaling counts as the smaller screen it is) and one column of two tab stacks where it is not
(laptops). Each panel sits in a vertical-only scroll area, so a short dock scrolls instead of pushing
the window's minimum height, and a panel's text changing never resizes a dock."""

from __future__ import annotations

import struct

from PySide6.QtCore import QByteArray, QEvent, QMargins, QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QDockWidget, QFrame, QMainWindow, QScrollArea, QWidget

PREFERRED = QSize(1600, 1000)  # the window's size where the screen has room for it
WIDE_FROM = 1680  # available width (device-independent pixels) from which the panels get two columns
FRAME = QMargins(8, 32, 8, 8)  # a window manager's borders and title bar, before the real ones are known
PANEL_MIN_HEIGHT = 110  # a dock shorter than its panel scrolls; below this it would show too little
RIGHT_DOCKS = ("dock-heatmap", "dock-budget", "dock-hit-rate", "dock-traffic", "dock-system", "dock-server")
GEOMETRY_MAGIC = 0x1D9D0CB  # QWidget.saveGeometry's header


# ----- the window on its screen -----
def fitted_geometry(available: QRect, preferred: QSize = PREFERRED, frame: QMargins = FRAME) -> QRect:
    """The window's own rectangle (frame not included): the preferred size or less, so that with its
    frame it lies within `available`, centred there."""
    room = available.marginsRemoved(frame)
    rect = QRect(QPoint(0, 0), preferred.boundedTo(room.size()))
    rect.moveCenter(room.center())
    return rect


def keep_on_screen(window: QWidget, available: QRect) -> None:
    """Once shown, with the window manager's real frame: shrink and move the window if that frame
    is larger than the allowance and pushed it past the screen's edge."""
    frame = window.frameGeometry()
    if available.contains(frame):
        return
    geometry = window.geometry()
    margins = QMargins(geometry.left() - frame.left(), geometry.top() - frame.top(),
                       frame.right() - geometry.right(), frame.bottom() - geometry.bottom())
    window.setGeometry(fitted_geometry(available, geometry.size(), margins))


def fits(size: QSize, available: QRect) -> bool:
    return size.width() <= available.width() and size.height() <= available.height()


def is_wide(available: QRect) -> bool:
    return available.width() >= WIDE_FROM


def saved_frame_size(geometry: QByteArray | bytes) -> QSize | None:
    """The frame size a QWidget.saveGeometry blob recorded (its header, unchanged since Qt 4: magic,
    version, then the frame as left, top, right, bottom), or None for anything else."""
    data = bytes(geometry)
    if len(data) < 24:
        return None
    magic, _major, _minor, left, top, right, bottom = struct.unpack(">IHHiiii", data[:24])
    if magic != GEOMETRY_MAGIC or right < left or bottom < top:
        return None
    return QSize(right - left + 1, bottom - top + 1)


# ----- the docks -----
class PanelScroll(QScrollArea):
    """A panel in a dock: as tall as the dock, or as tall as the panel's least when the dock is shorter
    (then it scrolls); never scrolled sideways, its minimum width being the panel's. Sized here rather
    than by widgetResizable, which would give a panel with wrapping text its preferred height: its plot
    would then scroll instead of shrinking."""

    def __init__(self, panel: QWidget, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(f"scroll-{getattr(panel, 'dock_name', '') or type(panel).__name__}")
        self.setWidget(panel)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        panel.installEventFilter(self)  # its content changed: its least height may have too

    def least_height(self, width: int) -> int:
        """The panel's minimum height at this width (wrapped text grows taller as the dock narrows)."""
        panel = self.widget()
        layout = panel.layout()
        if layout is not None and layout.hasHeightForWidth():
            least = layout.minimumHeightForWidth(width)
            if least > 0:
                return least
        return panel.minimumSizeHint().height()

    def _fit(self) -> None:
        width = self.viewport().width()
        self.widget().resize(width, max(self.viewport().height(), self.least_height(width)))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def eventFilter(self, watched, event) -> bool:
        if watched is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self._fit()
        return super().eventFilter(watched, event)

    def _with_bar(self, size: QSize) -> QSize:
        return QSize(size.width() + self.verticalScrollBar().sizeHint().width(), size.height())

    def minimumSizeHint(self) -> QSize:
        inner = self.widget().minimumSizeHint()
        return QSize(self._with_bar(inner).width(), min(inner.height(), PANEL_MIN_HEIGHT))

    def sizeHint(self) -> QSize:
        return self._with_bar(self.widget().sizeHint())


def arrange(window: QMainWindow, docks: dict[str, QDockWidget], wide: bool) -> None:
    """The panels' default arrangement right of the chat, for a wide screen or a narrow one."""
    area = Qt.DockWidgetArea.RightDockWidgetArea
    heat, budget, hit, traffic, system, server = (docks[name] for name in RIGHT_DOCKS)
    for dock in (heat, budget, hit, traffic, system, server):
        window.removeDockWidget(dock)
    window.addDockWidget(area, heat)
    if wide:  # two columns: what the experts do | how the cache performs
        window.splitDockWidget(heat, hit, Qt.Orientation.Horizontal)
        window.splitDockWidget(heat, budget, Qt.Orientation.Vertical)
        window.splitDockWidget(hit, traffic, Qt.Orientation.Vertical)
        window.splitDockWidget(traffic, system, Qt.Orientation.Vertical)
        window.tabifyDockWidget(system, server)  # a tab beside the system panel: out of the way until wanted
        front = (system,)
    else:  # one column: the heatmap over the budget slider, the others one tab away
        window.splitDockWidget(heat, budget, Qt.Orientation.Vertical)
        window.tabifyDockWidget(heat, hit)
        window.tabifyDockWidget(hit, traffic)
        window.tabifyDockWidget(budget, system)
        window.tabifyDockWidget(system, server)
        front = (heat, budget)
    for dock in (heat, budget, hit, traffic, system, server):
        dock.show()
    for dock in front:
        dock.raise_()


def default_sizes(window: QMainWindow, docks: dict[str, QDockWidget], wide: bool) -> None:
    """Proportions for the default arrangement; they only take once the window has its size."""
    d = docks
    width, height = window.width(), window.height()
    side = min(210, width // 7)
    horizontal, vertical = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
    if wide:
        column = (width - side) * 27 // 100
        window.resizeDocks([d["dock-conversations"], d["dock-heatmap"], d["dock-hit-rate"]], [side, column, column],
                           horizontal)
        window.resizeDocks([d["dock-hit-rate"], d["dock-traffic"], d["dock-system"]],
                           [height * 29 // 100, height * 39 // 100, height * 32 // 100], vertical)
        window.resizeDocks([d["dock-heatmap"], d["dock-budget"]], [height * 52 // 100, height * 48 // 100], vertical)
    else:  # the budget panel's text needs more of a short screen than the heatmap does
        column = (width - side) * 36 // 100
        window.resizeDocks([d["dock-conversations"], d["dock-heatmap"]], [side, column], horizontal)
        window.resizeDocks([d["dock-heatmap"], d["dock-budget"]], [height * 45 // 100, height * 55 // 100], vertical)
