"""Expert heatmap: layers x experts, colour = tokens routed, resident experts outlined, facts on hover."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from app.models.heatmap import HeatmapData, OutlineCache, colour_values, overlay_scale
from app.panels.base import Panel, integer_ticks, quiet_plot, style_plot
from app.panels.overlay_item import MaskOverlay
from app.themes import LIGHT, Theme
from engine import protocol as p

REMOTE_WAITING = ("No routing from this server yet. vLLM reports it when started with "
                  "--enable-return-routed-experts; SGLang through its expert-distribution record "
                  "(--expert-distribution-recorder-mode stat).")


def _lut(name: str = "inferno") -> np.ndarray:
    return pg.colormap.get(name).getLookupTable(0.0, 1.0, 256, alpha=False)


class HeatmapPanel(Panel):
    title = "Expert heatmap"
    dock_name = "dock-heatmap"
    MODES = (("This reply", "reply"), ("Since load", "total"))

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot: p.TelemetrySnapshot | None = None
        self.routing: p.RoutingSnapshot | None = None  # a remote server's routing (engine.remote)
        self.remote = ""
        self.data: HeatmapData | None = None
        self.expert_bytes: int | None = None
        self.peak = 0
        self.updates = 0  # renders done (tests, benchmark)
        self._shape: tuple[int, int] | None = None
        self._outline = OutlineCache()

        self.mode = QComboBox()
        for label, key in self.MODES:
            self.mode.addItem(label, key)
        self.mode.currentIndexChanged.connect(self._mode_changed)
        self.scale_label = QLabel("no data yet")
        self.scale_label.setWordWrap(True)  # long labels must not set the dock's minimum width
        self.hover_label = QLabel(" ")
        self.hover_label.setObjectName("heatmap-hover")
        self.hover_label.setWordWrap(True)

        self.plot = pg.PlotWidget()
        quiet_plot(self.plot)
        item = self.plot.getPlotItem()
        item.setLabel("left", "layer")
        item.setLabel("bottom", "expert")
        item.getViewBox().invertY(True)  # layer 0 on top, as the model runs
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(_lut())
        self.image.setLevels((0.0, 1.0))
        self.outline = MaskOverlay()
        self.outline.setZValue(1)
        self.plot.addItem(self.image)
        self.plot.addItem(self.outline)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        item.getViewBox().sigResized.connect(self._resized)
        self._outline_colour = LIGHT.outline
        self._set_outline_colour(LIGHT.outline)

        top = QHBoxLayout()
        top.addWidget(self.mode)
        top.addWidget(self.scale_label, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.hover_label)

    # ----- events -----
    def on_event(self, event) -> None:
        if isinstance(event, p.TelemetrySnapshot):
            self.snapshot = event
            self.dirty = True
        elif isinstance(event, p.RoutingSnapshot):
            self.routing = event
            self.dirty = True
        elif isinstance(event, p.ModelLoaded):
            self.expert_bytes = event.expert_bytes or None
            self.snapshot = self.routing = None
            self.remote = event.remote
            if event.remote:
                self.scale_label.setText(REMOTE_WAITING)

    def _mode_changed(self) -> None:
        self.dirty = self.snapshot is not None or self.routing is not None

    @property
    def mode_key(self) -> str:
        return self.mode.currentData()

    # ----- drawing -----
    def render(self) -> None:
        if self.remote and self.routing is not None:
            self.show_data(HeatmapData.from_routing(self.routing, self.mode_key))
        elif self.snapshot is not None and not self.remote:
            self.show_data(HeatmapData.from_snapshot(self.snapshot, self.mode_key))

    def show_data(self, data: HeatmapData) -> None:
        """The hot path (benchmarked): two setImage calls with fixed levels and a fixed LUT."""
        self.data = data
        values, self.peak = colour_values(data.counts)
        self.image.setImage(values, autoLevels=False, levels=(0.0, 1.0))
        layers, experts = data.counts.shape
        if self._shape != (layers, experts):
            self._set_shape(layers, experts)  # after setImage: ImageItem.setRect needs the image's size
        self._update_outline()
        streams = len(self.snapshot.streams) if self.snapshot is not None and not data.remote else 0
        span = "since load" if data.mode != "reply" else (
            f"the {streams} replies decoding together" if streams > 1 else "this reply")
        where = f"from {self.routing.source}" if data.remote and self.routing else "outlined = resident"
        self.scale_label.setText(f"brightest: {self.peak} tokens ({span}); {where}")
        self.updates += 1

    def _set_shape(self, layers: int, experts: int) -> None:
        # Cell (layer, expert) is centred on integer coordinates, so ticks name cells.
        self._shape = (layers, experts)
        rect = QRectF(-0.5, -0.5, experts, layers)
        self.image.setRect(rect)
        self.outline.set_rect(rect)
        item = self.plot.getPlotItem()
        item.getViewBox().setRange(xRange=(-0.5, experts - 0.5), yRange=(-0.5, layers - 0.5), padding=0)
        item.getAxis("bottom").setTicks([integer_ticks(experts)])
        item.getAxis("left").setTicks([integer_ticks(layers)])

    def _cell_pixels(self) -> tuple[float, float]:
        width, height = self.plot.getPlotItem().getViewBox().viewPixelSize()  # view units per screen pixel
        return (1.0 / width if width else 0.0), (1.0 / height if height else 0.0)

    def _update_outline(self) -> None:
        if self.data is None:
            return
        scale = overlay_scale(*self._cell_pixels())
        tint_before = self._outline.tint
        if self._outline.update(self.data.resident, scale):
            if self._outline.tint != tint_before:
                self._set_outline_colour(self._outline_colour)
            self.outline.set_mask(self._outline.mask)

    def _resized(self) -> None:
        self._update_outline()

    def _set_outline_colour(self, colour: str) -> None:
        self._outline_colour = colour
        self.outline.set_colour(QColor(colour), 110 if self._outline.tint else 255)  # a tint lets the heat show

    def apply_theme(self, theme: Theme) -> None:
        style_plot(self.plot, theme)
        self._set_outline_colour(theme.outline)
        if self._outline.mask is not None:
            self.outline.set_mask(self._outline.mask)

    # ----- hover -----
    def cell_at(self, scene_pos: QPointF) -> tuple[int, int] | None:
        if self.data is None:
            return None
        point = self.plot.getPlotItem().getViewBox().mapSceneToView(scene_pos)
        layer, expert = int(np.floor(point.y() + 0.5)), int(np.floor(point.x() + 0.5))
        layers, experts = self.data.counts.shape
        if 0 <= layer < layers and 0 <= expert < experts:
            return layer, expert
        return None

    def describe(self, layer: int, expert: int) -> str:
        return self.data.describe(layer, expert, self.expert_bytes) if self.data is not None else ""

    def _hover(self, scene_pos: QPointF) -> None:
        cell = self.cell_at(scene_pos)
        text = self.describe(*cell) if cell else " "
        self.hover_label.setText(text)
        self.plot.setToolTip(text.strip())
        if cell is None:
            QToolTip.hideText()
