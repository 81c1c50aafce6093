"""The model library: the catalog and the models already downloaded, Hub search, whether each model
fits this machine, downloads with progress, and "Use" to load one.

Everything goes through the engine (the GUI never imports torch or the Hub code): commands out
through the bridge, events back as `LibraryModel` updates. The dialog is modeless and lives as
long as the window, so a download goes on (and chatting with it) while the dialog is closed.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.format_picker import FormatPicker
from app.models.format_choices import card_quality
from app.models.library import LibraryModel, default_format, fit_lines, quant_choice_text
from engine import protocol as p

COLUMNS = ("Model", "Status", "Size", "Source", "Quant", "Fit", "Description")
DESCRIPTION = len(COLUMNS) - 1
VERDICT_COLOURS = {"fits-gpu": "#2e7d32", "fits-ram": "#2e7d32", "offload": "#1565c0", "too-big": "#c62828",
                   "unsupported": "#c62828"}
FIT_LABELS = ("Total size", "Experts", "Dense weights", "Minimum budget", "Recommended budget", "By format", "Download")


class LibraryDialog(QDialog):
    use_requested = Signal(str, str, str)  # checkpoint folder, budget ("": the app's remembered one), expert format

    def __init__(self, bridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.model = LibraryModel()
        self._engine_pid: int | None = bridge.pid  # commands already sent belong to this engine
        self._format_shown_for: str | None = None  # the model whose default format the picker shows
        self.setWindowTitle("Model library")
        self.setObjectName("library-dialog")
        self.resize(1100, 640)
        self._build_search()
        self._build_table()
        splitter = self._build_splitter(self._build_details())
        close = self._build_footer()
        self._lay_out(splitter, close)
        bridge.event.connect(self.on_event)
        self._refresh_all()

    # ----- construction -----
    def _build_search(self) -> None:
        self.search = QLineEdit()
        self.search.setPlaceholderText("Filter the list; Enter searches the Hugging Face Hub (or paste org/name)")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._filter)
        self.search.returnPressed.connect(self.search_hub)
        self.search_button = QPushButton("Search Hub")
        self.search_button.clicked.connect(self.search_hub)

    def _build_table(self) -> None:
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        for column in range(DESCRIPTION):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(DESCRIPTION, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.itemDoubleClicked.connect(lambda _item: self.use_selected())

    def _build_details(self) -> QWidget:
        """The selected model: verdict, numbers, the formats to load it in, notes."""
        self.title = QLabel("Select a model")
        self.title.setStyleSheet("font-weight: 600;")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.verdict = QLabel("")
        self.verdict.setObjectName("library-verdict")
        self.verdict.setWordWrap(True)
        self.form = self._build_fit_form()
        self.notes = QLabel("")
        self.notes.setWordWrap(True)
        self.notes.setStyleSheet("color: palette(placeholder-text);")
        details = QWidget()
        column = QVBoxLayout(details)
        column.addWidget(self.title)
        column.addWidget(self.verdict)
        column.addLayout(self.form)
        column.addWidget(self.notes)
        column.addStretch(1)
        return details

    def _build_fit_form(self) -> QFormLayout:
        self.numbers: dict[str, QLabel] = {}
        form = QFormLayout()
        for label in FIT_LABELS:
            value = QLabel("")
            value.setWordWrap(True)
            self.numbers[label] = value
            form.addRow(label, value)
        self.expert_format = FormatPicker("expert")
        self.expert_format.activated.connect(lambda _index: self._refresh_buttons())
        form.addRow("Load experts as", self.expert_format)
        self.quant_file = QComboBox()  # a GGUF repo's quant files, each with its verdict
        self.quant_file.setObjectName("quant-file")
        self.quant_file.activated.connect(lambda _index: self._quant_picked())
        form.addRow("Quant file", self.quant_file)
        return form

    def _build_splitter(self, details: QWidget) -> QSplitter:
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.table)
        splitter.addWidget(details)
        splitter.setSizes([680, 420])
        return splitter

    def _build_footer(self) -> QPushButton:
        """The download's progress, the status line and the buttons; returns the Close button."""
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setVisible(False)
        self.progress_label = QLabel("")
        self.status = QLabel("")
        self.status.setObjectName("library-status")
        self.status.setWordWrap(True)
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self.download_selected)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.clicked.connect(self.cancel_download)
        self.use_button = QPushButton("Use")
        self.use_button.setDefault(False)
        self.use_button.setAutoDefault(False)  # Enter in the search box searches; it never loads a model
        self.use_button.clicked.connect(self.use_selected)
        close = QPushButton("Close")
        close.setAutoDefault(False)
        close.clicked.connect(self.hide)
        for button in (self.search_button, self.download_button, self.cancel_button):
            button.setAutoDefault(False)
        return close

    def _lay_out(self, splitter: QSplitter, close: QPushButton) -> None:
        top = QHBoxLayout()
        top.addWidget(self.search, 1)
        top.addWidget(self.search_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress, 1)
        bottom.addWidget(self.progress_label, 2)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.cancel_button)
        bottom.addWidget(self.use_button)
        bottom.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(splitter, 1)
        layout.addWidget(self.status)
        layout.addLayout(bottom)

    # ----- commands -----
    def refresh(self) -> None:
        """Ask the engine for the catalog and the cached models again."""
        self.model.listing = True
        self._send(p.ListLibrary())
        self._refresh_status()

    def search_hub(self) -> None:
        text = self.search.text().strip()
        if not text:
            self.model.hub, self.model.hub_query = [], None
            self._refresh_all()
            return
        self.model.searching = text
        self.model.status, self.model.status_is_error = f"searching the Hub for “{text}”…", False
        self._send(p.SearchLibrary(text))
        self._refresh_status()

    def download_selected(self) -> None:
        repo = self.selected_repo()
        if repo is not None and self.model.can_download(repo, self.picked_quant()):
            picked = self.model.quant_fit(repo, self.picked_quant())
            what = f"{repo} ({picked.label})" if picked is not None else repo
            self.model.apply(p.DownloadProgress(repo, 0, 0, 0.0, None, f"starting the download of {what}…"))
            self._send(p.DownloadModel(repo, picked.label if picked is not None else ""))
            self._refresh_all()

    def picked_quant(self) -> str:
        return self.quant_file.currentData() or ""

    def _quant_picked(self) -> None:
        """Another quant file: its verdict and numbers replace the recommended one's headline."""
        picked = self.model.quant_fit(self.selected_repo(), self.picked_quant())
        if picked is not None:
            self.verdict.setText(f"{picked.label}: {picked.headline}")
            self.verdict.setStyleSheet(f"color: {VERDICT_COLOURS.get(picked.kind, 'palette(text)')};")
        self._refresh_buttons()

    def cancel_download(self) -> None:
        if self.model.download is not None:
            self._send(p.CancelDownload(self.model.download.repo_id))

    def use_selected(self) -> None:
        target = self.model.use_target(self.selected_repo(), self.expert_format.current(), self.picked_quant())
        if target is not None:
            self.hide()
            self.use_requested.emit(*target)

    def _send(self, command) -> None:
        if not self.bridge.send(command):  # no engine: nothing is under way
            self.model.engine_started()
            self.model.status, self.model.status_is_error = "the engine is not running; restart it first", True

    # ----- events -----
    def on_event(self, event) -> None:
        if isinstance(event, p.EngineStarted):
            if self._engine_pid is not None and event.pid != self._engine_pid:  # a restart: the old one's work is gone
                self.model.engine_started()
                self._refresh_all()
                if self.isVisible():
                    self.refresh()
            self._engine_pid = event.pid
            return
        crash = isinstance(event, p.Error) and event.kind == "engine-crashed"
        if not (p.is_library_event(event) or crash):
            return
        self.model.apply(event)
        if isinstance(event, p.DownloadProgress):
            self._refresh_download()
            self._refresh_status_cell(event.repo_id)
        elif isinstance(event, p.FitEstimateReady):
            self._refresh_row(event.repo_id)
            self._refresh_details()
        else:
            if isinstance(event, p.DownloadFinished):
                self.estimate(event.repo_id)  # now from the downloaded files; the old one stands until then
            self._refresh_all()

    # ----- drawing -----
    def selected_repo(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            return None
        item = self.table.item(rows[0].row(), 0)
        return item.data(Qt.ItemDataRole.UserRole) if item is not None else None

    def select(self, repo_id: str) -> bool:
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.ItemDataRole.UserRole).lower() == repo_id.lower():
                self.table.selectRow(row)
                return True
        return False

    def _filter(self, text: str) -> None:
        self.model.filter_text = text
        self._refresh_rows()

    def _refresh_all(self) -> None:
        self._refresh_rows()
        self._refresh_download()
        self._refresh_status()

    def _refresh_rows(self) -> None:
        selected = self.selected_repo()
        rows = self.model.rows()
        self.table.blockSignals(True)  # a rebuild is no new selection (that would re-estimate)
        self.table.setRowCount(len(rows))
        for row, entry in enumerate(rows):
            name = QTableWidgetItem(self.model.name_text(entry))
            name.setData(Qt.ItemDataRole.UserRole, entry.repo_id)
            name.setToolTip(entry.local_path or {"catalog": "from MoEScope's catalog",
                                                 "search": "a Hub search result"}.get(entry.source, ""))
            self.table.setItem(row, 0, name)
            self.table.setItem(row, 3, QTableWidgetItem(self.model.source_text(entry)))
            self.table.setItem(row, 4, QTableWidgetItem(entry.quant))
            self.table.setItem(row, DESCRIPTION, QTableWidgetItem(entry.description))
            self._fill_row(row, entry)
        self.table.clearSelection()
        if selected is not None:
            self.select(selected)  # the same model stays selected: no new estimate, no retry
        self.table.blockSignals(False)
        self._refresh_details()

    def _fill_row(self, row: int, entry: p.LibraryEntry) -> None:
        status = QTableWidgetItem(self.model.status_text(entry))
        if entry.problem:
            status.setToolTip(entry.problem)
        self.table.setItem(row, 1, status)
        self.table.setItem(row, 2, QTableWidgetItem(self.model.size_text(entry)))
        fit = QTableWidgetItem(self.model.fit_text(entry))
        fit.setToolTip(self.model.fit_headline(entry))
        kind = self.model.fit_kind(entry)
        if kind in VERDICT_COLOURS:
            fit.setForeground(QColor(VERDICT_COLOURS[kind]))
        self.table.setItem(row, 5, fit)

    def _row_of(self, repo_id: str) -> int | None:
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.ItemDataRole.UserRole).lower() == repo_id.lower():
                return row
        return None

    def _refresh_row(self, repo_id: str) -> None:
        row, entry = self._row_of(repo_id), self.model.entry(repo_id)
        if row is not None and entry is not None:
            self._fill_row(row, entry)

    def _refresh_status_cell(self, repo_id: str) -> None:
        row, entry = self._row_of(repo_id), self.model.entry(repo_id)
        if row is not None and entry is not None:
            self.table.item(row, 1).setText(self.model.status_text(entry))

    def _selection_changed(self) -> None:
        repo = self.selected_repo()
        if repo is not None:
            self.model.estimate_errors.pop(repo.lower(), None)  # selecting again tries again
            if self.model.needs_estimate(repo):
                self.estimate(repo)
        self._refresh_details()

    def estimate(self, repo_id: str) -> None:
        self.model.estimating.add(repo_id.lower())
        self._send(p.EstimateModel(repo_id))

    def _refresh_details(self) -> None:
        repo = self.selected_repo()
        entry = self.model.entry(repo) if repo else None
        est = self.model.estimate(repo) if repo else None
        error = self.model.estimate_errors.get(repo.lower()) if repo else None
        self.title.setText(self.model.name_text(entry) if entry is not None else repo or "Select a model")
        for label in self.numbers.values():
            label.setText("")
        notes = []
        if est is not None:
            self.verdict.setText(est.headline + (f"\n{est.format_summary}" if est.format_summary else ""))
            self.verdict.setStyleSheet(f"color: {VERDICT_COLOURS.get(est.kind, 'palette(text)')};")
            for label, value in fit_lines(est):
                self.numbers[label].setText(value)
            notes = list(est.notes)
        elif entry is not None and entry.fit_headline:  # the listing's verdict until the estimate comes
            self.verdict.setText(entry.fit_headline)
            self.verdict.setStyleSheet(f"color: {VERDICT_COLOURS.get(entry.fit_kind or '', 'palette(text)')};")
        elif error is not None:
            self.verdict.setText(error)
            self.verdict.setStyleSheet(f"color: {VERDICT_COLOURS['too-big']};")
        else:
            self.verdict.setText("estimating the fit for this machine…" if repo else "")
            self.verdict.setStyleSheet("")
        if entry is not None and entry.problem:
            notes.insert(0, entry.problem)
        if entry is not None and entry.local_path:
            notes.append(f"in {entry.local_path}")
        self._show_quants(est)
        if repo != self._format_shown_for:  # a new selection or estimate: its own default, its card's figures
            self.expert_format.set_quality(card_quality(entry.local_path) if entry is not None and entry.local_path
                                           else {})
            self.expert_format.show_format(default_format(est))
            self._format_shown_for = repo if est is not None else None
        self.notes.setText("\n".join(notes))
        self._refresh_buttons()

    def _show_quants(self, est: p.FitEstimateReady | None) -> None:
        """A GGUF repo picks a quant file instead of a format to convert to; other models the other way round."""
        quants = est.quants if est is not None else []
        keep = self.picked_quant() or (est.quant if est is not None else "")
        self.quant_file.clear()
        for fit in quants:
            self.quant_file.addItem(quant_choice_text(fit), fit.label)
            self.quant_file.setItemData(self.quant_file.count() - 1, fit.headline, Qt.ItemDataRole.ToolTipRole)
        if quants:
            index = self.quant_file.findData(keep)
            self.quant_file.setCurrentIndex(index if index >= 0 else self.quant_file.findData(est.quant))
        self.form.setRowVisible(self.quant_file, bool(quants))
        self.form.setRowVisible(self.expert_format, not quants)
        if quants and self.picked_quant() != est.quant:
            self._quant_picked()

    def _refresh_download(self) -> None:
        state = self.model.download
        self.progress.setVisible(state is not None)
        if state is not None:
            fraction = state.fraction
            if fraction is None:
                self.progress.setRange(0, 0)  # busy until the size is known
            else:
                self.progress.setRange(0, 1000)
                self.progress.setValue(int(fraction * 1000))
            self.progress.setFormat(f"{state.repo_id} %p%")
            self.progress_label.setText(state.text)
        else:
            self.progress_label.setText("")
        self._refresh_buttons()

    def _refresh_buttons(self) -> None:
        repo = self.selected_repo()
        state = self.model.download
        quant = self.picked_quant()
        self.download_button.setEnabled(self.model.can_download(repo, quant))
        self.cancel_button.setVisible(state is not None)
        self.cancel_button.setEnabled(state is not None and not state.cancelling)
        self.use_button.setEnabled(self.model.use_target(repo, self.expert_format.current(), quant) is not None)

    def _refresh_status(self) -> None:
        text = self.model.status
        if not text and self.model.listing:
            text = "reading the catalog and the Hugging Face cache…"
        self.status.setText(text)
        self.status.setStyleSheet(f"color: {VERDICT_COLOURS['too-big']};" if self.model.status_is_error else "")
        self._refresh_buttons()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.search.setFocus()
