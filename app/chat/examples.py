"""Example prompts on an empty chat with the demo model: one button per skill its card claims, asked as
the model was trained to be asked (a 3.4 M-parameter model answers those phrasings and little else),
and a line saying what the model is for. Clicking one sends it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.models.format_choices import CARD_FILE, model_folder
from engine.demo.corpus import EXAMPLES  # stdlib only: the phrasings the demo was trained on

COLUMNS = 2


@dataclass(frozen=True)
class ExampleOffer:
    about: str = ""  # one line: what this model is and is for
    prompts: list[str] = field(default_factory=list)  # one per claimed skill, in the card's order


def demo_offer(model_path: str) -> ExampleOffer:
    """The examples for a model folder with a demo card (`moescope_demo.json`); none for any other model."""
    try:
        card = json.loads((model_folder(model_path) / CARD_FILE).read_text(encoding="utf-8"))
        skills, params = list(card["skills"]), int(card["params"])
    except (OSError, ValueError, KeyError, TypeError):
        return ExampleOffer()
    prompts = [EXAMPLES[skill].user for skill in skills if skill in EXAMPLES]
    if not prompts:
        return ExampleOffer()
    about = (f"MoEScope's demo model, {params / 1e6:.1f} M parameters, for watching the engine work: it answers "
             "questions like these, asked this way, and little else.")
    return ExampleOffer(about, prompts)


class ExamplePrompts(QWidget):
    """The about line and a grid of prompt buttons; empty and hidden for models without examples."""

    picked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.about = QLabel("")
        self.about.setObjectName("examples-about")
        self.about.setWordWrap(True)
        self.grid = QGridLayout()
        self.grid.setSpacing(6)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.about)
        layout.addLayout(self.grid)
        self.buttons: list[QPushButton] = []
        self.setVisible(False)

    @property
    def offered(self) -> bool:
        return bool(self.buttons)

    def offer(self, offer: ExampleOffer) -> None:
        for button in self.buttons:
            self.grid.removeWidget(button)
            button.deleteLater()
        self.about.setText(offer.about)
        self.buttons = [self._button(text) for text in offer.prompts]
        for i, button in enumerate(self.buttons):
            self.grid.addWidget(button, i // COLUMNS, i % COLUMNS)

    def _button(self, text: str) -> QPushButton:
        button = QPushButton(text)
        button.setObjectName("example-prompt")
        button.setToolTip("Send this message")
        button.clicked.connect(lambda: self.picked.emit(text))
        return button
