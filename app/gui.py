"""Starting the window: the Qt application, high-DPI policy, the main window, screenshot mode."""

from __future__ import annotations

import argparse
import sys
import tempfile

from PySide6.QtCore import Qt, QtMsgType, qInstallMessageHandler
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

QUIET = ("propagateSizeHints",)  # the offscreen platform's harmless complaint, once per window


def _qt_messages(kind: QtMsgType, _context, message: str) -> None:
    if kind == QtMsgType.QtDebugMsg or any(q in message for q in QUIET):
        return
    print(f"qt: {message}", file=sys.stderr)


def make_application() -> QApplication:
    app = QApplication.instance()
    if isinstance(app, QApplication):
        return app
    # Fractional scale factors (125 %, 150 %) as they are, not rounded: crisp text and plots.
    QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    qInstallMessageHandler(_qt_messages)
    app = QApplication(sys.argv[:1])
    app.setApplicationName("MoEScope")
    app.setOrganizationName("MoEScope")
    app.setDesktopFileName("moescope")
    return app


def run_gui(args: argparse.Namespace) -> int:
    app = make_application()
    from app.main_window import MainWindow
    from app.models.history import HistoryStore
    from app.settings import AppSettings

    screenshot = bool(args.screenshot)
    settings = AppSettings()
    store = None
    if screenshot:
        # A throwaway history and settings: a scripted screenshot must not touch the user's own.
        scratch = tempfile.mkdtemp(prefix="moescope-screenshot-")
        settings = AppSettings(f"{scratch}/settings.ini")
        store = HistoryStore(f"{scratch}/history.sqlite3")
    if args.theme:
        settings.theme = args.theme
    window = MainWindow(settings=settings, store=store, remember=not screenshot)
    if screenshot:
        window.resize(1600, 1000)
    window.show()
    window.start_engine(args.model, args.budget)
    if screenshot:
        from app.screenshot import ScreenshotRun

        ScreenshotRun(window, args.prompt, args.screenshot, args.timeout)
    return app.exec()
