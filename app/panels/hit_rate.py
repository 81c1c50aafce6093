"""Cache hit rate over time: overall (recent window) and one chosen layer, cumulative figures as text."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.models.telemetry_history import TelemetryHistory, connections
from app.panels.base import Panel, quiet_plot, style_plot, translucent
from app.themes import LIGHT, Theme
from engine import protocol as p

WINDOW_S = 60.0  # the visible span of the scrolling plot


class HitRatePanel(Panel):
    title = "Cache hit rate"
    dock_name = "dock-hit-rate"
    local_only = True

    def __init__(self, history: TelemetryHistory, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.layer = QComboBox()
        self.layer.addItem("no layer", -1)
        self.layer.currentIndexChanged.connect(self._mark_dirty)
        self.figures = QLabel("waiting for the engine…")
        self.figures.setWordWrap(True)

        self.plot = pg.PlotWidget()
        quiet_plot(self.plot)
        item = self.plot.getPlotItem()
        item.setLabel("left", "hit rate", units="%")
        item.setLabel("bottom", "engine time", units="s")
        item.setYRange(0, 100, padding=0.02)
        item.showGrid(y=True, alpha=0.2)
        self.legend = item.addLegend(offset=(10, -10))  # bottom left: hit rates live near the top
        self.overall = item.plot([], [], name="overall (recent tokens)")
        self.chosen = item.plot([], [], name="layer (this reply)")
        self.apply_theme(LIGHT)

        top = QHBoxLayout()
        top.addWidget(QLabel("Layer:"))
        top.addWidget(self.layer)
        top.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.figures)

    def _mark_dirty(self) -> None:
        self.dirty = True

    def on_event(self, event) -> None:
        if isinstance(event, p.TelemetrySnapshot):
            self.dirty = True
        elif isinstance(event, p.ModelLoaded):
            keep = self.layer.currentData()
            self.layer.blockSignals(True)
            self.layer.clear()
            self.layer.addItem("no layer", -1)
            for i in range(event.num_layers):
                self.layer.addItem(f"layer {i}", i)
            self.layer.setCurrentIndex(max(0, self.layer.findData(keep)))
            self.layer.blockSignals(False)

    def render(self) -> None:
        s = self.history.latest
        if s is None:
            return
        t = self.history.series.times()
        joined = connections(t)
        self.overall.setData(t, 100.0 * self.history.series.column("hit_rate_recent"), connect=joined)
        index = self.layer.currentData()
        if index is not None and index >= 0:
            values = self.history.layer_request.layer(index)
            n = len(values)
            self.chosen.setData(t[-n:] if n else [], 100.0 * values, connect=joined[-n:] if n else "all")
        else:
            self.chosen.setData([], [])
        if len(t):
            self.plot.getPlotItem().setXRange(max(t[-1] - WINDOW_S, t[0]), t[-1] + 0.5, padding=0)
        self.figures.setText(self.figures_text(s, index))

    @staticmethod
    def figures_text(s: p.TelemetrySnapshot, layer: int | None = None) -> str:
        text = (f"Since load <b>{s.hit_rate_total:.1%}</b> · this reply {s.hit_rate_request:.1%} · "
                f"last {s.recent_window} tokens {s.hit_rate_recent:.1%}")
        if layer is not None and layer >= 0:
            rates = s.layer_hit_rate.numpy()
            if layer < len(rates):
                text += f" · layer {layer} since load {float(rates[layer]):.1%}"
        return text

    def apply_theme(self, theme: Theme) -> None:
        style_plot(self.plot, theme)
        self.overall.setPen(pg.mkPen(theme.series[0], width=2))
        self.chosen.setPen(pg.mkPen(theme.series[1], width=1.5))
        self.legend.setLabelTextColor(theme.plot_foreground)
        self.legend.setBrush(translucent(theme.plot_background, 210))

