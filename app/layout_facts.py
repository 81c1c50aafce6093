"""What a user would notice about the window's layout, as plain data: where the window and its docks
are against the screen, which docks show and which are a tab away, and which labels cut their text
off without a tooltip saying it. Screenshot mode reports it; the layout tests assert on it."""

from __future__ import annotations

from PySide6.QtCore import QRect
from PySide6.QtWidgets import QDockWidget, QLabel, QMainWindow, QScrollArea, QTabBar, QWidget

from app.elided_label import ElidedLabel


def _rect(r: QRect) -> list[int]:
    return [r.x(), r.y(), r.width(), r.height()]


def _in_window(widget: QWidget, window: QWidget) -> QRect:
    return QRect(widget.mapTo(window, widget.rect().topLeft()), widget.size())


def _shown(widget: QWidget) -> bool:
    """On screen now: visible and not pushed out of sight (a dock behind another's tab is moved away)."""
    return widget.isVisible() and not widget.visibleRegion().isEmpty()


def _tab_titles(window: QMainWindow) -> set[str]:
    return {bar.tabText(i) for bar in window.findChildren(QTabBar) if bar.isVisible() for i in range(bar.count())}


def dock_facts(window: QMainWindow) -> dict[str, dict]:
    """Each dock: shown, or a tab beside a shown one (one click away), floating or closed, and where."""
    tabs = _tab_titles(window)
    facts = {}
    for dock in window.findChildren(QDockWidget):
        shown = _shown(dock)
        behind = [d.objectName() for d in window.tabifiedDockWidgets(dock) if _shown(d)]
        facts[dock.objectName()] = {
            "title": dock.windowTitle(), "shown": shown, "closed": dock.isHidden(), "floating": dock.isFloating(),
            "tab_beside": behind[0] if not shown and behind and dock.windowTitle() in tabs else None,
            "geometry": _rect(_in_window(dock, window)) if shown else None,
        }
    return facts


def _inside_scroll_area(label: QLabel) -> bool:
    parent = label.parentWidget()
    while parent is not None:
        if isinstance(parent, QScrollArea):
            return True
        parent = parent.parentWidget()
    return False


def label_problem(label: QLabel) -> str | None:
    """Why this label's text is cut off with nothing showing the rest, or None when it is readable."""
    text = label.text()
    if not text.strip():
        return None
    if isinstance(label, ElidedLabel):
        return None if not label.elided() or text in label.toolTip() else "elided without its text in the tooltip"
    if label.toolTip().strip() and text in label.toolTip():
        return None
    hint = label.minimumSizeHint() if label.wordWrap() else label.sizeHint()
    if hint.width() > label.width():
        return f"needs {hint.width()} px, has {label.width()}"
    needed = label.heightForWidth(label.width()) if label.wordWrap() else hint.height()
    if needed > label.height():
        return f"needs {needed} px of height, has {label.height()}"
    if _shown(label) and not _inside_scroll_area(label) and label.visibleRegion().boundingRect() != label.rect():
        return "partly hidden by its parent"  # a squeezed parent cuts it; a scroll area's viewport would scroll
    return None


def clipped_labels(window: QWidget) -> list[str]:
    """Every visible label whose text is cut off without a tooltip, described for a failure message."""
    found = []
    for label in window.findChildren(QLabel):
        if not label.isVisible() or label.window() is not window:
            continue
        problem = label_problem(label)
        if problem:
            found.append(f"{label.objectName() or type(label).__name__} '{label.text()[:60]}': {problem}")
    return found


def window_facts(window: QMainWindow) -> dict:
    screen = window.screen()
    central = window.centralWidget()
    return {
        "screen": _rect(screen.geometry()), "available": _rect(screen.availableGeometry()),
        "device_pixel_ratio": window.devicePixelRatioF(),
        "frame": _rect(window.frameGeometry()), "geometry": _rect(window.geometry()),
        "minimum_size_hint": [window.minimumSizeHint().width(), window.minimumSizeHint().height()],
        "minimum_size": [window.minimumSize().width(), window.minimumSize().height()],
        "central": _rect(_in_window(central, window)) if central is not None else None,
        "docks": dock_facts(window),
        "clipped_labels": clipped_labels(window),
    }


def layout_signature(facts: dict) -> dict:
    """What must not move when the model reloads: the window, the chat and each dock shown."""
    return {"frame": facts["frame"], "central": facts["central"],
            "docks": {name: dock["geometry"] for name, dock in facts["docks"].items()}}
