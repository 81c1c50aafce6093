"""Light and dark themes: a Fusion palette plus the few colours the panels and the chat draw with.

"system" follows the platform's colour scheme (and its changes); "light"/"dark" override it.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

CHOICES = ("system", "light", "dark")


@dataclass(frozen=True)
class Theme:
    name: str  # light | dark
    window: str
    base: str
    alt_base: str
    text: str
    muted: str
    accent: str
    border: str
    code_background: str
    code_style: str  # a Pygments style
    user_bubble: str
    plot_background: str
    plot_foreground: str
    series: tuple[str, ...]  # line colours: overall, layer, on-demand, prefetch, pcie, stall
    outline: str  # resident experts on the heatmap
    warning_background: str
    error_background: str


LIGHT = Theme(
    name="light", window="#f3f3f5", base="#ffffff", alt_base="#f7f7f9", text="#1d1d1f", muted="#6e6e73",
    accent="#2f6fde", border="#d2d2d7", code_background="#eceef2", code_style="default", user_bubble="#e8f0fe",
    plot_background="#ffffff", plot_foreground="#333333",
    series=("#2f6fde", "#e07b00", "#d93b3b", "#2e9e5b", "#7a4fd6", "#8a8a8a"),
    outline="#00c8ff", warning_background="#fff4d6", error_background="#fde2e1",
)
DARK = Theme(
    name="dark", window="#1e1f22", base="#26272b", alt_base="#2c2d31", text="#e6e6e6", muted="#9a9aa0",
    accent="#5b9bff", border="#3d3e44", code_background="#1b1c1f", code_style="one-dark", user_bubble="#2b3850",
    plot_background="#1b1c1f", plot_foreground="#cfcfcf",
    series=("#5b9bff", "#ffaa33", "#ff6b6b", "#4cd187", "#b28cff", "#aaaaaa"),
    outline="#00e5ff", warning_background="#4a3d12", error_background="#5a2224",
)


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    scheme = hints.colorScheme() if hasattr(hints, "colorScheme") else Qt.ColorScheme.Unknown
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    # Unknown (offscreen, older desktops): guess from the default palette's window lightness.
    return QApplication.style().standardPalette().color(QPalette.ColorRole.Window).lightness() < 128


def resolve(choice: str) -> Theme:
    if choice == "dark":
        return DARK
    if choice == "light":
        return LIGHT
    return DARK if system_is_dark() else LIGHT


def palette_for(theme: Theme) -> QPalette:
    pal = QPalette()
    role = QPalette.ColorRole
    colors = {
        role.Window: theme.window, role.WindowText: theme.text, role.Base: theme.base,
        role.AlternateBase: theme.alt_base, role.Text: theme.text, role.Button: theme.alt_base,
        role.ButtonText: theme.text, role.ToolTipBase: theme.base, role.ToolTipText: theme.text,
        role.Highlight: theme.accent, role.HighlightedText: "#ffffff", role.Link: theme.accent,
        role.PlaceholderText: theme.muted, role.Mid: theme.border,
    }
    for r, c in colors.items():
        pal.setColor(r, QColor(c))
    for r in (role.WindowText, role.Text, role.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, r, QColor(theme.muted))
    return pal


class ThemeManager(QObject):
    """Applies the chosen theme to the application and tells the views when it changes."""

    changed = Signal(object)  # Theme

    def __init__(self, choice: str = "system", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.choice = choice if choice in CHOICES else "system"
        self.theme = resolve(self.choice)
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):
            hints.colorSchemeChanged.connect(self._system_changed)

    def set_choice(self, choice: str) -> None:
        self.choice = choice if choice in CHOICES else "system"
        self.apply()

    def apply(self) -> None:
        self.theme = resolve(self.choice)
        app = QApplication.instance()
        if isinstance(app, QApplication):
            app.setStyle("Fusion")  # the same look on every platform, and palettes are honoured
            app.setPalette(palette_for(self.theme))
        self.changed.emit(self.theme)

    def _system_changed(self, *_args) -> None:
        if self.choice == "system":
            self.apply()
