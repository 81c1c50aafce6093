"""Connect to a server…: the URL of an OpenAI-compatible server (vLLM, SGLang, another MoEScope...), an
optional API key, and a model chosen from its /v1/models."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit, QPushButton, QWidget

DEFAULT_URL = "http://127.0.0.1:8000/v1"  # vLLM's default port


class ConnectDialog(QDialog):
    _listed = Signal(object)  # a list of model ids, or the reason as a string (from the listing thread)

    def __init__(self, parent: QWidget | None = None, url: str = DEFAULT_URL) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to a server")
        self.url = QLineEdit(url)
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional")
        self.model = QComboBox()
        self.model.setEditable(True)
        self.list_button = QPushButton("List models")
        self.list_button.clicked.connect(self.list_models)
        self.status = QLabel("Lists the models the server offers (GET /v1/models).")
        self.status.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(False)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self._listed.connect(self._show_models, Qt.ConnectionType.QueuedConnection)
        form = QFormLayout(self)
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        form.addRow(self.list_button, self.model)
        form.addRow(self.status)
        form.addRow(self.buttons)

    def list_models(self) -> None:
        from engine.remote.client import RemoteError, RemoteTarget, list_models

        target = RemoteTarget(self.url.text(), self.key.text() or None)
        self.list_button.setEnabled(False)
        self.status.setText(f"Asking {target.base}…")

        def ask() -> None:
            try:
                self._listed.emit([str(entry.get("id")) for entry in list_models(target)])
            except RemoteError as exc:
                self._listed.emit(str(exc))

        threading.Thread(target=ask, name="moescope-list-models", daemon=True).start()

    def _show_models(self, result: list[str] | str) -> None:
        self.list_button.setEnabled(True)
        if isinstance(result, str):
            self.status.setText(result)
            return
        self.model.clear()
        self.model.addItems(result)
        self.status.setText(f"{len(result)} model(s) served." if result else "The server serves no model.")
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(bool(result))

    def values(self) -> tuple[str, str | None, str]:
        return self.url.text().strip(), self.key.text() or None, self.model.currentText().strip()
