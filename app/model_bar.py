"""The current model: name, size, how much of it sits in compute memory, the formats its experts and
dense weights are stored in (a new choice reloads it); open another one."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.elided_label import ElidedLabel
from app.format_picker import FormatPicker
from app.models import format_choices
from app.models.stats_format import format_bytes
from engine import protocol as p


def model_summary(m: p.ModelLoaded, budget_bytes: int) -> str:
    if m.remote:
        context = f" · context {m.context_length} tokens" if m.context_length else ""
        return f"remote engine at {m.remote}{context} · the server runs the model and its memory"
    total = m.dense_bytes + m.all_expert_bytes
    resident = m.dense_bytes + budget_bytes
    return (f"{format_bytes(total)} · {m.num_layers} MoE layers x {m.num_experts} experts (top-{m.top_k}) · "
            f"in {m.device} memory: {format_bytes(resident)} ({resident / total:.0%}) · "
            f"{format_choices.loaded_formats_text(m.expert_format, m.dense_format, m.dtype)}, store {m.store}"
            + (f" · {p.TEXT_ONLY_NOTE}" if m.text_only else ""))


def _button(text: str) -> QToolButton:
    """A button as wide as its text (a push button is at least 80 px: three of them crowd a laptop's chat column)."""
    button = QToolButton()
    button.setText(text)
    button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
    return button


class ModelBar(QWidget):
    open_folder_requested = Signal(str)
    library_requested = Signal()
    connect_requested = Signal()
    formats_requested = Signal(str, str)  # experts, dense: the user picked another format

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model: p.ModelLoaded | None = None
        self.loading = False
        # One line each, elided with the full text in the tooltip: a long name or summary (a reload in
        # another format) must neither widen the window nor change the bar's height.
        self.name = ElidedLabel("No model", min_chars=8, mode=Qt.TextElideMode.ElideMiddle)
        self.name.setObjectName("model-name")
        self.name.setStyleSheet("font-weight: 600;")
        self.details = ElidedLabel("")
        self.details.setObjectName("model-details")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setMinimumWidth(60)
        # The load's progress takes the summary's place, not room of its own: the bar's minimum width
        # (and so the window's) is the same loading or not.
        self.status = QStackedWidget()
        self.status.addWidget(self.details)
        self.status.addWidget(self.progress)
        self.library = _button("Library…")
        self.library.setToolTip("Model library: browse, size up and download models, and load one (Ctrl+L)")
        self.library.clicked.connect(self.library_requested)
        self.open_button = _button("Open…")
        self.open_button.setToolTip("Open a model folder: load a local checkpoint (safetensors)")
        self.open_button.clicked.connect(self.choose_folder)
        self.expert_format = FormatPicker("expert")
        self.dense_format = FormatPicker("dense")
        for picker in (self.expert_format, self.dense_format):
            picker.setEnabled(False)  # until a local model is loaded
            picker.activated.connect(self._format_picked)
        self.connect_button = _button("Connect…")
        self.connect_button.setToolTip("Connect to a server: chat with a model served by vLLM, SGLang or another "
                                       "OpenAI-compatible server")
        self.connect_button.clicked.connect(self.connect_requested)
        self._build_layout()

    def _build_layout(self) -> None:
        """Two fixed rows, so the bar fits a laptop's chat column: the model and where to get another,
        then the formats it is stored in."""
        top = QHBoxLayout()
        top.addWidget(self.name)
        top.addWidget(self.status, 1)
        top.addWidget(self.library)
        top.addWidget(self.open_button)
        top.addWidget(self.connect_button)
        formats_row = QHBoxLayout()
        formats_row.addWidget(QLabel("Experts"))
        formats_row.addWidget(self.expert_format, 1)  # the pickers take the room there is: whole labels where it allows
        formats_row.addWidget(QLabel("Dense"))
        formats_row.addWidget(self.dense_format, 1)
        column = QVBoxLayout(self)
        column.setContentsMargins(8, 4, 8, 4)
        column.setSpacing(4)
        column.addLayout(top)
        column.addLayout(formats_row)

    def on_event(self, event) -> None:
        if isinstance(event, p.LoadProgress):
            self._show_progress(event.fraction < 1.0)
            self.progress.setValue(int(event.fraction * 1000))
            self.progress.setFormat(f"{event.message} %p%")
        elif isinstance(event, p.ModelLoaded):
            self.model, self.loading = event, False
            self._show_progress(False)
            self.name.setText(event.name)
            self.name.setToolTip(event.path)
            self.details.setText(model_summary(event, event.budget_bytes))
            quality = {} if event.remote else format_choices.card_quality(event.path)
            for picker, name in ((self.expert_format, event.expert_format), (self.dense_format, event.dense_format)):
                picker.set_quality(quality)
                picker.show_format(name)
                picker.setEnabled(not event.remote)
        elif isinstance(event, p.BudgetChanged) and self.model is not None:
            self.details.setText(model_summary(self.model, event.budget_bytes))
        elif isinstance(event, p.Error) and (event.kind == "engine-crashed" or self.loading):
            self._show_progress(False)  # a load that failed, or a crash: no model now
            self.model, self.loading = None, False
            self.details.setText(f"not loaded: {event.message}")

    def _format_picked(self, _index: int) -> None:
        self.formats_requested.emit(self.expert_format.current(), self.dense_format.current())

    def show_formats(self, expert_format: str, dense_format: str) -> None:
        """The formats a load asked for, shown while it runs (the engine's ModelLoaded confirms them)."""
        self.expert_format.show_format(expert_format)
        self.dense_format.show_format(dense_format)

    def set_loading(self, path: str) -> None:
        self.name.setText(path)
        self.details.setText("loading…")
        self.loading = True
        self.progress.setValue(0)
        self._show_progress(True)

    def _show_progress(self, on: bool) -> None:
        self.status.setCurrentWidget(self.progress if on else self.details)

    def choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a checkpoint folder")
        if folder:
            self.open_folder_requested.emit(folder)
