"""`moescope --screenshot OUT.png --prompt TEXT`: send the prompt, wait for the reply and a telemetry
update, let the panels draw, save the whole window, and quit (exit code 0, or 1 with the reason).

On success it also prints one JSON line on stdout for scripts and tests: the file, the Qt platform
the window ran on, the reply, where the expert heatmap's cells are in the saved image, and the
window's layout against the screen (app/layout_facts.py). With --reload-as FORMAT it then reloads
the model with its experts in FORMAT, asks again in a new chat, and reports the layout once more.

`moescope --screenshot OUT.png --library NAME`: open the model library instead, select the row named
NAME once the listing is in, and save the library dialog when that model's verdict has arrived."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QRect, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

from app.layout_facts import window_facts
from app.main_window import FRAME_MS, MainWindow
from engine import protocol as p


class _Run(QObject):
    """What both screenshot modes share: a deadline, and quitting with one line on failure."""

    window: MainWindow
    finished: bool
    _deadline: QTimer

    def _fail(self, reason: str) -> None:
        print(f"moescope: error: screenshot failed: {reason}", file=sys.stderr)
        self._deadline.stop()
        self.finished = True
        self.window.close()
        QApplication.exit(1)


class ScreenshotRun(_Run):
    def __init__(self, window: MainWindow, prompt: str, out: str, timeout_s: float,
                 reload_as: str | None = None, show: list[str] | None = None) -> None:
        super().__init__(window)
        self.window, self.prompt, self.out = window, prompt, Path(out)
        self.reload_as = reload_as
        self.show = show or []  # panels whose tabs come to the front before the grab
        self.report: dict | None = None  # filled at the first capture; a reload adds its layout
        self.done: p.Done | None = None
        self.snapshots_at_send = 0
        self.finished = False
        window.bridge.event.connect(self._event)
        window.chat.reply_finished.connect(self._reply_done)
        self._deadline = QTimer(self, singleShot=True)
        self._deadline.timeout.connect(lambda: self._fail(f"no reply within {timeout_s:.0f} s"))
        self._deadline.start(int(timeout_s * 1000))
        window.chat.new_chat()
        window.chat.send(prompt)  # queued until the model has loaded

    def _event(self, event) -> None:
        if isinstance(event, p.ModelLoaded):
            self.snapshots_at_send = self.window.history.count
        elif (isinstance(event, p.Error) and not event.recoverable) or (isinstance(event, p.Error) and event.request_id is not None):
            self._fail(event.message)
        elif isinstance(event, p.TelemetrySnapshot):
            self._maybe_capture()

    def _reply_done(self, done: p.Done) -> None:
        self.done = done
        self._maybe_capture()

    def _maybe_capture(self) -> None:
        if self.finished or self.done is None or self.window.history.count <= self.snapshots_at_send:
            return
        self.finished = True
        # A few frame ticks so every panel has drawn the final snapshot before the grab.
        QTimer.singleShot(4 * FRAME_MS, self._capture)

    def _capture(self) -> None:
        for name in self.show:
            dock = self.window.docks.get(f"dock-{name}")
            if dock is None:
                self._fail(f"no panel named {name!r} (one of: {', '.join(d.removeprefix('dock-') for d in self.window.docks)})")
                return
            dock.raise_()
        self.window.refresh()
        for panel in self.window.panels:
            panel.dirty = True
        self.window.refresh()
        QApplication.processEvents()
        if self.report is not None:  # back from the reload: the same layout is the point
            self.report["layout_after_reload"] = window_facts(self.window)
            self.report["model_after_reload"] = self.model_facts()
            self._finish()
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if not self.window.grab().save(str(self.out)):
            self._fail(f"could not write {self.out}")
            return
        print(f"moescope: saved {self.out} ({len(self.done.text) if self.done else 0} characters of reply)",
              file=sys.stderr)
        ratio = self.window.devicePixelRatioF()
        cells = self.heatmap_cells()
        self.report = {
            "screenshot": str(self.out),
            "platform": QGuiApplication.platformName(),
            "reply": self.done.text if self.done else "",
            "heatmap_cells": [round(v * ratio) for v in (cells.x(), cells.y(), cells.width(), cells.height())],
            "heatmap_renders": self.window.heatmap.updates,
            "layout": window_facts(self.window),
            "model": self.model_facts(),
        }
        if self.reload_as:
            self._reload()
        else:
            self._finish()

    def _reload(self) -> None:
        """The model bar's pick of another expert format, then the same question in a new chat."""
        self.done, self.finished = None, False
        self.window.set_formats(self.reload_as, self.window.model_bar.dense_format.current())
        self.window.chat.new_chat()
        self.window.chat.send(self.prompt)  # queued until the reloaded model is in

    def _finish(self) -> None:
        print(json.dumps(self.report), flush=True)
        self._deadline.stop()
        self.window.close()
        QApplication.exit(0)

    def model_facts(self) -> dict:
        """The loaded model's expert format and budget, to tell that a reload kept the budget's share."""
        model = self.window.bridge.model
        if model is None:
            return {}
        return {"expert_format": model.expert_format, "all_expert_bytes": model.all_expert_bytes,
                "budget_bytes": self.window.bridge.budget_bytes}

    def heatmap_cells(self) -> QRect:
        """The heatmap's image (its layer x expert cells) in window coordinates, clipped to the plot area."""
        heatmap = self.window.heatmap
        scene = heatmap.image.sceneBoundingRect() & heatmap.plot.getPlotItem().getViewBox().sceneBoundingRect()
        in_view = heatmap.plot.mapFromScene(scene).boundingRect()
        return QRect(heatmap.plot.viewport().mapTo(self.window, in_view.topLeft()), in_view.size())


class LibraryScreenshotRun(_Run):
    def __init__(self, window: MainWindow, name: str, out: str, timeout_s: float) -> None:
        super().__init__(window)
        self.window, self.name, self.out = window, name, Path(out)
        self.dialog = None
        self.finished = False
        window.bridge.event.connect(self._event)
        self._deadline = QTimer(self, singleShot=True)
        self._deadline.timeout.connect(lambda: self._fail(f"no verdict for '{name}' within {timeout_s:.0f} s"))
        self._deadline.start(int(timeout_s * 1000))

    def _event(self, event) -> None:
        if isinstance(event, p.EngineStarted) and self.dialog is None:
            self.dialog = self.window.open_library()
            self.dialog.resize(1600, 800)
        elif isinstance(event, p.LibraryListing) and event.query is None and self.dialog is not None:
            QTimer.singleShot(0, self._select)  # after the dialog has drawn the rows
        elif (isinstance(event, (p.FitEstimateReady, p.Error)) and self.dialog is not None and not self.finished
              and self.dialog.selected_repo() is not None):
            self.finished = True
            QTimer.singleShot(4 * FRAME_MS, self._capture)

    def _select(self) -> None:
        table = self.dialog.table
        for row in range(table.rowCount()):
            if table.item(row, 0).text() == self.name:
                table.selectRow(row)
                return
        self._fail(f"the library lists no '{self.name}'")

    def _capture(self) -> None:
        QApplication.processEvents()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if not self.dialog.grab().save(str(self.out)):
            self._fail(f"could not write {self.out}")
            return
        rows = [[self.dialog.table.item(r, c).text() for c in range(self.dialog.table.columnCount())]
                for r in range(self.dialog.table.rowCount())]
        print(json.dumps({"screenshot": str(self.out), "platform": QGuiApplication.platformName(), "rows": rows,
                          "verdict": self.dialog.verdict.text()}), flush=True)
        self._deadline.stop()
        self.window.close()
        QApplication.exit(0)
