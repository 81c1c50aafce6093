"""Transfer traffic into the cache: on-demand stacked on prefetch, the driver's PCIe counter beside
our own count when there is a GPU, and stall time per token below."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.models.stats_format import format_bytes, format_rate
from app.models.telemetry_history import TelemetryHistory, connections
from app.panels.base import Panel, quiet_plot, style_plot, translucent
from app.panels.hit_rate import WINDOW_S
from app.themes import LIGHT, Theme
from engine import protocol as p


class TrafficPanel(Panel):
    title = "Transfer traffic"
    dock_name = "dock-traffic"
    local_only = True

    def __init__(self, history: TelemetryHistory, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.link = QLabel("link: –")
        self.link.setWordWrap(True)
        self.figures = QLabel(" ")
        self.figures.setWordWrap(True)

        self.plot = pg.PlotWidget()
        quiet_plot(self.plot)
        item = self.plot.getPlotItem()
        item.setLabel("left", "into the cache", units="B/s")
        item.showGrid(y=True, alpha=0.2)
        self.legend = item.addLegend(offset=(10, 10))
        self.zero = pg.PlotDataItem([], [])
        self.prefetch = item.plot([], [], name="prefetch")
        self.total = item.plot([], [], name="on-demand (stacked)")
        self.pcie = pg.PlotDataItem([], [])  # joins the plot and legend once the driver reports
        self.fill_prefetch = pg.FillBetweenItem(self.zero, self.prefetch)
        self.fill_ondemand = pg.FillBetweenItem(self.prefetch, self.total)
        item.addItem(self.fill_prefetch)
        item.addItem(self.fill_ondemand)

        self.stall_plot = pg.PlotWidget()
        quiet_plot(self.stall_plot)
        stall_item = self.stall_plot.getPlotItem()
        stall_item.setLabel("left", "stall", units="s")
        stall_item.setLabel("bottom", "engine time", units="s")
        stall_item.showGrid(y=True, alpha=0.2)
        stall_item.setXLink(item)
        self.stall = stall_item.plot([], [])
        self.stall_plot.setMinimumHeight(90)
        self.stall_plot.setMaximumHeight(150)
        self.apply_theme(LIGHT)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.link)
        layout.addWidget(self.plot, 3)
        layout.addWidget(self.stall_plot, 1)
        layout.addWidget(self.figures)

    def on_event(self, event) -> None:
        if isinstance(event, p.TelemetrySnapshot):
            self.dirty = True

    def render(self) -> None:
        s = self.history.latest
        if s is None:
            return
        series = self.history.series
        t = series.times()
        prefetch = np.nan_to_num(series.column("bytes_per_s_prefetch"))
        total = prefetch + np.nan_to_num(series.column("bytes_per_s_ondemand"))
        self.zero.setData(t, np.zeros_like(t))
        self.prefetch.setData(t, prefetch)
        self.total.setData(t, total)
        pcie = series.column("pcie_rx_bytes_per_s")
        top = float(total.max()) if len(total) else 0.0
        if np.isfinite(pcie).any():
            if self.pcie.scene() is None:
                self.plot.getPlotItem().addItem(self.pcie)
                self.legend.addItem(self.pcie, "PCIe counter (driver)")
            self.pcie.setData(t, pcie, connect="finite")
            top = max(top, float(np.nanmax(pcie)))
        stall = np.nan_to_num(series.column("stall_s_per_token"))
        self.stall.setData(t, stall, connect=connections(t))
        if len(t):
            self.plot.getPlotItem().setXRange(max(t[-1] - WINDOW_S, t[0]), t[-1] + 0.5, padding=0)
        # Rates are never negative: pin the floor at zero, give an idle link a small ceiling.
        self.plot.getPlotItem().setYRange(0, max(top * 1.1, 1024.0), padding=0)
        self.stall_plot.getPlotItem().setYRange(0, max(float(stall.max()) * 1.1 if len(stall) else 0.0, 1e-3), padding=0)
        self.link.setText(f"link: <b>{s.link}</b>")
        self.figures.setText(self.figures_text(s))

    @staticmethod
    def figures_text(s: p.TelemetrySnapshot) -> str:
        text = (f"on-demand {format_rate(s.bytes_per_s_ondemand)} · prefetch {format_rate(s.bytes_per_s_prefetch)}"
                f" · stall {s.stall_s_per_token * 1000:.1f} ms/token · loaded since start {format_bytes(s.bytes_loaded_total)}")
        if s.pcie_rx_bytes_per_s is not None:
            text += f" · PCIe rx (driver) {format_rate(s.pcie_rx_bytes_per_s)}"
        if s.sharing is not None and len(s.streams) > 1:  # replies decoding together read shared experts once
            text += f" · {s.sharing.line()}"
        return text

    def apply_theme(self, theme: Theme) -> None:
        style_plot(self.plot, theme)
        style_plot(self.stall_plot, theme)
        on_demand, prefetch, pcie, stall = theme.series[2], theme.series[3], theme.series[4], theme.series[5]
        self.prefetch.setPen(pg.mkPen(prefetch, width=1))
        self.total.setPen(pg.mkPen(on_demand, width=1))
        self.fill_prefetch.setBrush(translucent(prefetch))
        self.fill_ondemand.setBrush(translucent(on_demand))
        self.pcie.setPen(pg.mkPen(pcie, width=2, style=pg.QtCore.Qt.PenStyle.DashLine))
        self.stall.setPen(pg.mkPen(stall, width=1.5))
        self.legend.setLabelTextColor(theme.plot_foreground)
        self.legend.setBrush(translucent(theme.plot_background, 210))
