"""Starting the window: the Qt application, high-DPI policy, the main window, screenshot mode."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import ClassVar

from PySide6.QtCore import Qt, QtMsgType, qInstallMessageHandler
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

from app import platform_check

QUIET = ("propagateSizeHints",)  # the offscreen platform's harmless complaint, once per window


class _Startup:
    """While the QApplication is being made, Qt's messages are held back: if the platform fails, Qt
    calls qFatal (then abort()) and the handler turns it into one line and a clean exit instead.
    This is the fallback behind platform_check.window_problem (which runs first and catches missing
    libraries and displays); it needs no QT_DEBUG_PLUGINS run, Qt's warnings already say enough."""

    active: ClassVar[bool] = False
    held: ClassVar[list[str]] = []


def _qt_messages(kind: QtMsgType, _context, message: str) -> None:
    if kind == QtMsgType.QtFatalMsg and _Startup.active:
        print(platform_check.startup_failure_line(platform_check.platforms_to_try(os.environ), _Startup.held),
              file=sys.stderr, flush=True)
        os._exit(platform_check.EXIT_NO_WINDOW)  # Qt would abort() right after this handler returns
    debug_asked = bool(os.environ.get("QT_DEBUG_PLUGINS"))  # the user asked for Qt's plugin-loading details
    if (kind == QtMsgType.QtDebugMsg and not debug_asked) or any(q in message for q in QUIET):
        return
    if _Startup.active and kind != QtMsgType.QtDebugMsg:
        _Startup.held.append(message)
        return
    print(f"qt: {message}", file=sys.stderr)


def make_application() -> QApplication:
    app = QApplication.instance()
    if isinstance(app, QApplication):
        return app
    # Fractional scale factors (125 %, 150 %) as they are, not rounded: crisp text and plots.
    QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    qInstallMessageHandler(_qt_messages)
    _Startup.active, _Startup.held = True, []
    app = QApplication(sys.argv[:1])
    _Startup.active = False
    for message in _Startup.held:  # it started: what Qt said on the way is worth showing as usual
        print(f"qt: {message}", file=sys.stderr)
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
    window = MainWindow(settings=settings, store=store, remember=not screenshot)  # sized to fit its screen
    window.show()
    window.start_engine(args.model, args.budget)
    if screenshot and args.library:
        from app.screenshot import LibraryScreenshotRun

        LibraryScreenshotRun(window, args.library, args.screenshot, args.timeout)
    elif screenshot:
        from app.screenshot import ScreenshotRun

        ScreenshotRun(window, args.prompt, args.screenshot, args.timeout, reload_as=args.reload_as, show=args.show)
    return app.exec()
