"""A weight format picker (the model bar's, the model library's): Original, then the block formats,
each quantized one marked approximate with its measured cost on the model when its card has one."""

from __future__ import annotations

from PySide6.QtWidgets import QComboBox, QWidget

from app.models import format_choices

SHOWN_CHARS = 10  # the closed picker's narrowest: "4-bit (Q4…"; the whole label in the list and the tooltip


class FormatPicker(QComboBox):
    """One weight format picker: Original, then the block formats, each quantized one marked approximate."""

    def __init__(self, what: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(f"{what}-format")
        self.explanation = (f"How the {what} weights are stored: the original weights, or a block format "
                            "(approximate; converted once into MoEScope's cache folder, with progress). "
                            "Changing it reloads the model.")
        # Sized for a short label, not the longest one (a measured cost makes labels long): the picker
        # must not widen the window when a model card adds figures.
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(SHOWN_CHARS)
        self.currentIndexChanged.connect(self._show_tip)
        self.set_quality({})

    def set_quality(self, quality: dict[str, format_choices.FormatQuality]) -> None:
        """Labels and tooltips for the model at hand (its card's measured costs), keeping the choice."""
        current = self.current()
        self.blockSignals(True)
        self.clear()
        for name in format_choices.CHOICES:
            self.addItem(format_choices.choice_label(name, quality), name)
            self.setItemData(self.count() - 1, format_choices.choice_tip(name, quality), 3)  # Qt.ToolTipRole
        self.show_format(current)
        self.blockSignals(False)
        widest = max(self.fontMetrics().horizontalAdvance(self.itemText(i)) for i in range(self.count()))
        self.view().setMinimumWidth(widest + 32)  # the open list shows every label whole
        self._show_tip()

    def current(self) -> str:
        return self.currentData() or format_choices.ORIGINAL

    def show_format(self, name: str) -> None:
        self.blockSignals(True)
        self.setCurrentIndex(max(0, self.findData(format_choices.canonical(name))))
        self.blockSignals(False)
        self._show_tip()

    def _show_tip(self) -> None:
        """The whole label of the choice (the closed picker may cut it short), then what the picker does."""
        self.setToolTip(f"{self.currentText()}\n\n{self.explanation}" if self.currentText() else self.explanation)
