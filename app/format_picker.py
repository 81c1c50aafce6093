"""A weight format picker (the model bar's, the model library's): Original, then the block formats,
each quantized one marked approximate with its measured cost on the model when its card has one."""

from __future__ import annotations

from PySide6.QtWidgets import QComboBox, QWidget

from app.models import formats


class FormatPicker(QComboBox):
    """One weight format picker: Original, then the block formats, each quantized one marked approximate."""

    def __init__(self, what: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(f"{what}-format")
        self.setToolTip(f"How the {what} weights are stored: the original weights, or a block format (approximate; "
                        "converted once into MoEScope's cache folder, with progress). Changing it reloads the model.")
        self.set_quality({})

    def set_quality(self, quality: dict[str, formats.FormatQuality]) -> None:
        """Labels and tooltips for the model at hand (its card's measured costs), keeping the choice."""
        current = self.current()
        self.blockSignals(True)
        self.clear()
        for name in formats.CHOICES:
            self.addItem(formats.choice_label(name, quality), name)
            self.setItemData(self.count() - 1, formats.choice_tip(name, quality), 3)  # Qt.ToolTipRole
        self.show_format(current)
        self.blockSignals(False)

    def current(self) -> str:
        return self.currentData() or formats.ORIGINAL

    def show_format(self, name: str) -> None:
        self.blockSignals(True)
        self.setCurrentIndex(max(0, self.findData(formats.canonical(name))))
        self.blockSignals(False)
