"""Memory budget: a slider from the minimum to everything, free memory marked, slots per layer as bars,
the planner's estimate under the cursor while dragging, and the budget applied on release."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QSlider, QVBoxLayout, QWidget

from app.elided_label import ElidedLabel
from app.models.budget import BudgetScale, free_compute_memory, memory_breakdown
from app.models.budget_estimate import Estimate, Estimator
from app.models.stats_format import format_bytes
from app.panels.base import Panel, integer_ticks, quiet_plot, style_plot
from app.themes import LIGHT, Theme
from engine import protocol as p

EstimateFn = Callable[[int], Estimate | None]
APPLY_DELAY_MS = 400  # keyboard and wheel steps: apply once the user pauses


class ScaleBar(QWidget):
    """The slider's range drawn as a bar: green while the budget fits in free memory, red beyond."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.fraction_free: float | None = None  # position of the free-memory mark, 0..1 of the range
        self.label = ""
        self.ok, self.bad, self.text = QColor("#2e9e5b"), QColor("#d93b3b"), QColor("#333333")
        self.setMinimumHeight(13 + self.fontMetrics().height())  # the bar, then one line of label under it
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_free(self, fraction: float | None, label: str) -> None:
        self.fraction_free, self.label = fraction, label
        self.setToolTip(f"{label}: green while the budget fits in it, red beyond" if label else "")
        self.update()

    def _label_place(self, cut: float, margin: int) -> tuple[QRectF, str]:
        """Where the free-memory label goes: beside the mark (after it, or before it near the right end),
        always inside the bar, cut short with "…" only when the bar is narrower than the label."""
        metrics = self.fontMetrics()
        text = metrics.elidedText(self.label, Qt.TextElideMode.ElideRight, max(self.width() - 2, 0))
        width = metrics.horizontalAdvance(text) + 1
        fraction = self.fraction_free if self.fraction_free is not None else 0.0
        if fraction > 1.0:  # everything fits: at the right end
            x = self.width() - margin - width
        elif fraction < 0.6:  # after the mark
            x = cut + 4
        else:  # before the mark, so it does not run off the right end
            x = cut - 4 - width
        x = min(max(x, 0.0), self.width() - width)
        return QRectF(x, 12, width, metrics.height()), text

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        margin = 8  # roughly where QSlider's groove starts and ends
        width = self.width() - 2 * margin
        bar = QRectF(margin, 4, width, 6)
        if self.fraction_free is None:
            painter.fillRect(bar, self.ok.lighter(150))
        else:
            cut = margin + width * min(max(self.fraction_free, 0.0), 1.0)
            painter.fillRect(QRectF(bar.left(), bar.top(), cut - bar.left(), bar.height()), self.ok)
            if cut < bar.right():
                painter.fillRect(QRectF(cut, bar.top(), bar.right() - cut, bar.height()), self.bad)
            if 0.0 <= self.fraction_free <= 1.0:
                painter.setPen(QPen(self.text, 2))
                painter.drawLine(int(cut), 1, int(cut), 13)
            if self.fraction_free >= 0.0:
                rect, text = self._label_place(cut, margin)
                painter.setPen(self.text)
                painter.drawText(rect, Qt.AlignmentFlag.AlignLeft, text)
        painter.end()


class BudgetPanel(Panel):
    title = "Memory budget"
    dock_name = "dock-budget"
    local_only = True
    budget_requested = Signal(str)  # what SetBudget should carry

    def __init__(self, estimator: EstimateFn | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model: p.ModelLoaded | None = None
        self.scale: BudgetScale | None = None
        self.snapshot: p.TelemetrySnapshot | None = None
        self.budget_bytes = 0
        self.slots: list[int] = []
        self.pending: str | None = None  # requested, not yet confirmed by BudgetChanged
        self.preview: Estimate | None = None
        self.estimator: EstimateFn = estimator or self._planner_estimate
        self._planner = Estimator()
        self._build_slider()
        self._build_readouts()
        self._build_plot()
        self.apply_theme(LIGHT)
        self._lay_out()

    # ----- construction -----
    def _build_slider(self) -> None:
        """The heading, the slider with the free-memory bar under it, and the range's two ends."""
        self.heading = QLabel("No model loaded")
        self.heading.setWordWrap(True)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setEnabled(False)
        self.slider.setTracking(True)
        self.slider.sliderMoved.connect(self._dragged)
        self.slider.sliderReleased.connect(self._released)
        self.slider.valueChanged.connect(self._stepped)
        self.scale_bar = ScaleBar()
        self.ends = QHBoxLayout()
        # Elided, not widening: the ends' text changes with every model and format.
        self.min_label, self.max_label = ElidedLabel("–", min_chars=4), ElidedLabel("–", min_chars=4)
        self.max_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.ends.addWidget(self.min_label)
        self.ends.addStretch(1)
        self.ends.addWidget(self.max_label)

    def _build_readouts(self) -> None:
        """The estimate, the note and the engine's memory under the slider; the delay before a budget applies."""
        self.estimate_label = QLabel(" ")
        self.estimate_label.setWordWrap(True)
        self.note = QLabel("")
        self.note.setWordWrap(True)
        self.note.setVisible(False)
        self.memory_label = QLabel("")
        self.memory_label.setWordWrap(True)
        self.memory_label.setToolTip(
            "The engine process's resident memory. Engine overhead is what it costs by itself (Python, torch, "
            "transformers, the model's code and tokenizer), measured at load: a memory limit loses it before "
            "the expert budget.")
        self._apply_timer = QTimer(self, singleShot=True, interval=APPLY_DELAY_MS)
        self._apply_timer.timeout.connect(self._apply_current)

    def _build_plot(self) -> None:
        """Slots per MoE layer: the engine's bars, and the planned ones outlined over them."""
        self.plot = pg.PlotWidget()
        quiet_plot(self.plot)
        item = self.plot.getPlotItem()
        item.setLabel("left", "slots")
        item.setLabel("bottom", "MoE layer")
        item.showGrid(y=True, alpha=0.2)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8)
        self.planned = pg.BarGraphItem(x=[], height=[], width=0.8)
        self.planned.setZValue(1)
        item.addItem(self.bars)
        item.addItem(self.planned)
        self.plot.setMinimumHeight(120)

    def _lay_out(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.heading)
        layout.addWidget(self.slider)
        layout.addWidget(self.scale_bar)
        layout.addLayout(self.ends)
        layout.addWidget(self.estimate_label)
        layout.addWidget(self.memory_label)
        layout.addWidget(self.note)
        layout.addWidget(self.plot, 1)

    # ----- events -----
    def on_event(self, event) -> None:
        if isinstance(event, p.ModelLoaded):
            self.model = event
            self.scale = BudgetScale(event.min_budget_bytes, event.max_budget_bytes, event.expert_bytes)
            self.slider.blockSignals(True)
            self.slider.setRange(0, self.scale.steps)
            self.slider.setPageStep(max(1, self.scale.steps // 10))
            self.slider.blockSignals(False)
            self.slider.setEnabled(True)
            self.min_label.setText(f"min {format_bytes(event.min_budget_bytes)}")
            self.max_label.setText(f"everything {format_bytes(event.max_budget_bytes)}")
            self._set_current(event.budget_bytes, event.slots_per_layer)
            self._show_note(event.budget_note)
        elif isinstance(event, p.BudgetChanged):
            self.pending = None
            self._set_current(event.budget_bytes, event.slots_per_layer)
            self._show_note(event.note)
        elif isinstance(event, p.TelemetrySnapshot):
            self.snapshot = event
            if self.pending is None and not self.slider.isSliderDown() and event.slots_per_layer != self.slots:
                self._set_current(event.budget_bytes, event.slots_per_layer)
            self.dirty = True
        elif isinstance(event, p.Error) and event.kind == "engine-crashed":
            self.slider.setEnabled(False)

    def _set_current(self, budget_bytes: int, slots: list[int]) -> None:
        self.budget_bytes, self.slots = budget_bytes, list(slots)
        if self.scale is not None and not self.slider.isSliderDown():
            self.slider.blockSignals(True)
            self.slider.setValue(self.scale.to_position(budget_bytes))
            self.slider.blockSignals(False)
        self.dirty = True

    def _show_note(self, note: str) -> None:
        self.note.setText(note)
        self.note.setVisible(bool(note))

    # ----- the slider -----
    def _dragged(self, position: int) -> None:
        """While dragging: the planner's estimate for the position under the cursor, nothing sent."""
        self._preview(position)

    def _released(self) -> None:
        self._apply_timer.stop()
        self._request(self.slider.value())

    def _stepped(self, position: int) -> None:
        if self.slider.isSliderDown():
            return  # a drag: sliderMoved previews, sliderReleased applies
        self._preview(position)
        self._apply_timer.start()

    def _apply_current(self) -> None:
        self._request(self.slider.value())

    def _request(self, position: int) -> None:
        if self.scale is None:
            return
        text = self.scale.budget_text(position)
        self.pending = text
        self.preview = None
        self.budget_requested.emit(text)
        self.dirty = True

    def _preview(self, position: int) -> None:
        if self.scale is None:
            return
        nbytes = self.scale.to_bytes(position)
        self.preview = self.estimator(nbytes)
        self.estimate_label.setText(self.estimate_text(nbytes, self.preview))
        self.dirty = True
        self.render()  # dragging must feel immediate; this panel is cheap

    def _planner_estimate(self, nbytes: int) -> Estimate | None:
        return self._planner(nbytes, self.model, self.snapshot)

    @staticmethod
    def estimate_text(nbytes: int, estimate: Estimate | None, label: str = "") -> str:
        head = f"{label or 'At ' + format_bytes(nbytes)}: "
        if estimate is None:
            return head + "no estimate yet (the planner needs a few tokens of routing history)"
        text = head + f"predicted hit rate <b>{estimate.hit_rate:.1%}</b>"
        if estimate.tokens_per_s is not None:
            text += f" · ~{estimate.tokens_per_s:.1f} tok/s"
        return text

    # ----- drawing -----
    def render(self) -> None:
        if self.model is None or self.scale is None:
            return
        m = self.model
        slots = np.asarray(self.slots, dtype=float)
        avg = slots.mean() if len(slots) else 0.0
        pending = " (applying…)" if self.pending else ""
        self.heading.setText(
            f"Budget <b>{format_bytes(self.budget_bytes)}</b> of {format_bytes(m.max_budget_bytes)} "
            f"({self.scale.fraction(self.budget_bytes):.0%}) · {avg:.1f} of {m.num_experts} slots per layer{pending}"
        )
        parts = memory_breakdown(m, self.snapshot)
        self.memory_label.setText(
            f"Engine RAM {format_bytes(self.snapshot.rss_bytes)}: " + " · ".join(
                f"{name} {format_bytes(nbytes)}" for name, nbytes in parts) if parts else "")
        # the marker needs no overhead taken off: the running engine's own memory is already not free
        free = free_compute_memory(self.snapshot, self.budget_bytes)
        if free is not None:
            where, nbytes = free
            span = max(m.max_budget_bytes - m.min_budget_bytes, 1)
            fraction = (nbytes - m.min_budget_bytes) / span
            label = f"{where} {format_bytes(nbytes)}" + ("" if fraction <= 1 else " (everything fits)")
            self.scale_bar.set_free(fraction, label)
        x = np.arange(len(slots))
        self.bars.setOpts(x=x, height=slots, width=0.8)
        if self.preview is not None and self.slider.isSliderDown():
            self.planned.setOpts(x=x, height=np.asarray(self.preview.slots_per_layer, dtype=float), width=0.5)
            self.planned.setVisible(True)
        else:
            self.planned.setVisible(False)
        self.plot.getPlotItem().setYRange(0, m.num_experts, padding=0.05)
        self.plot.getPlotItem().getAxis("bottom").setTicks([integer_ticks(len(slots))])
        if not self.slider.isSliderDown() and self.preview is None:
            current = self.estimator(self.budget_bytes) if self.snapshot is not None else None
            hint = "Drag the slider: the estimate follows the cursor; release to apply."
            self.estimate_label.setText(self.estimate_text(self.budget_bytes, current, "Now") + ". " + hint
                                        if current else hint)

    def apply_theme(self, theme: Theme) -> None:
        style_plot(self.plot, theme)
        self.bars.setOpts(brush=QColor(theme.series[0]), pen=pg.mkPen(None))
        self.planned.setOpts(brush=QColor(0, 0, 0, 0), pen=pg.mkPen(theme.series[1], width=2))
        self.scale_bar.text = QColor(theme.text)
        self.scale_bar.update()
