"""A conversation's own system prompt, sampling settings, and what happens when its context is full."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QDoubleSpinBox, QFormLayout, QPlainTextEdit, QSpinBox, QWidget

from engine.protocol import CONTEXT_OVERFLOW, SamplingSettings

# protocol.CONTEXT_OVERFLOW in words, as LM Studio's "context overflow" setting
OVERFLOW_LABELS = {"drop-oldest": "Drop the oldest turns", "stop": "Stop with a message"}
OVERFLOW_TIP = ("When the conversation outgrows the model's context: leave its oldest turns out of what the model sees "
                "(they stay in the history; a marker shows where its memory starts), or stop and say so")


class ConversationSettingsForm(QWidget):
    changed = Signal(str, object)  # system prompt, SamplingSettings
    overflow_changed = Signal(str)  # one of protocol.CONTEXT_OVERFLOW

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._loading = False
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.system_prompt.setFixedHeight(60)
        self.temperature = self._double(0.0, 2.0, 0.05, "0 = greedy (the same reply every time)")
        self.top_p = self._double(0.0, 1.0, 0.01, "nucleus sampling: keep the smallest set of tokens with this probability")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100000)
        self.top_k.setSpecialValueText("off")
        self.repetition_penalty = self._double(0.5, 2.0, 0.01, "above 1 discourages repeating tokens")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 1 << 20)
        self.overflow = QComboBox()
        for value in CONTEXT_OVERFLOW:
            self.overflow.addItem(OVERFLOW_LABELS[value], value)
        self.overflow.setToolTip(OVERFLOW_TIP)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("System prompt", self.system_prompt)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("When the context is full", self.overflow)
        self.system_prompt.textChanged.connect(self._edited)
        for box in (self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.max_tokens):
            box.valueChanged.connect(self._edited)
        self.overflow.currentIndexChanged.connect(self._overflow_edited)

    @staticmethod
    def _double(low: float, high: float, step: float, tip: str) -> QDoubleSpinBox:
        box = QDoubleSpinBox()
        box.setRange(low, high)
        box.setSingleStep(step)
        box.setDecimals(2)
        box.setToolTip(tip)
        return box

    def load(self, system_prompt: str, sampling: SamplingSettings, overflow: str = CONTEXT_OVERFLOW[0]) -> None:
        self._loading = True  # programmatic: not a user edit
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(overflow)))
        self.system_prompt.setPlainText(system_prompt)
        self.temperature.setValue(sampling.temperature)
        self.top_p.setValue(sampling.top_p)
        self.top_k.setValue(sampling.top_k)
        self.repetition_penalty.setValue(sampling.repetition_penalty)
        self.max_tokens.setValue(sampling.max_new_tokens)
        self._loading = False

    def sampling(self, base: SamplingSettings | None = None) -> SamplingSettings:
        base = base or SamplingSettings()
        return SamplingSettings(
            temperature=self.temperature.value(), top_p=self.top_p.value(), top_k=self.top_k.value(),
            repetition_penalty=self.repetition_penalty.value(), max_new_tokens=self.max_tokens.value(),
            seed=base.seed, stop=list(base.stop),
        )

    def overflow_value(self) -> str:
        return self.overflow.currentData()

    def _overflow_edited(self) -> None:
        if not self._loading:
            self.overflow_changed.emit(self.overflow_value())

    def _edited(self) -> None:
        if not self._loading:
            self.changed.emit(self.system_prompt.toPlainText(), self.sampling())
