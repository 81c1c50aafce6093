"""The "Local server" dock: the switch, the port, the URL to copy, the replies decoding now, and a log of
the API's requests."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.local_server import LocalServer
from app.panels.base import Panel
from engine import protocol as p
from engine.serve import DEFAULT_PORT

LOG_LINES = 200


class ServerPanel(Panel):
    title = "Local server"
    dock_name = "dock-server"

    def __init__(self, server: LocalServer, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.server = server
        self.switch = QCheckBox("Local server (OpenAI, Ollama)")
        self.switch.setToolTip("Serve the loaded model to editors, agents and scripts on this machine only, "
                               "over OpenAI's API (the URL below) and Ollama's (the same address without /v1)")
        self.switch.toggled.connect(self._toggled)
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("any")  # 0: any free port
        self.port.setValue(DEFAULT_PORT)
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setPlaceholderText("off")
        self.copy = QPushButton("Copy")
        self.copy.setEnabled(False)
        self.copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        self.status = QLabel("Off. Turn it on to serve the model on 127.0.0.1 (this machine only).")
        self.status.setWordWrap(True)
        self.queue = QLabel("")  # the API requests running and waiting, while the server is on
        self.queue.setWordWrap(True)
        server.queue_changed.connect(self._show_queue)
        self.running = QLabel("")  # the replies decoding now (the window's chat among them), from telemetry
        self.running.setWordWrap(True)
        self._streams: list[p.StreamInfo] = []
        self._sharing: p.BatchSharing | None = None
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(LOG_LINES)
        self.log.setPlaceholderText("API requests appear here")
        server.request_logged.connect(self.add_entry)

        # The switch, the port, the URL: one row each, so the panel fits a laptop's narrow column.
        port = QHBoxLayout()
        port.addWidget(QLabel("Port:"))
        port.addWidget(self.port)
        port.addStretch(1)
        address = QHBoxLayout()
        address.addWidget(self.url, 1)
        address.addWidget(self.copy)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.switch)
        layout.addLayout(port)
        layout.addLayout(address)
        layout.addWidget(self.status)
        layout.addWidget(self.queue)
        layout.addWidget(self.running)
        layout.addWidget(self.log, 1)

    def _toggled(self, on: bool) -> None:
        if on:
            problem = self.server.start(self.port.value())
            if problem is not None:
                self.status.setText(problem)
                self.switch.blockSignals(True)
                self.switch.setChecked(False)
                self.switch.blockSignals(False)
                return
            self.url.setText(self.server.url)
            model = self.server.bridge.model.name if self.server.bridge.model else ""
            self.status.setText(f"Listening on this machine only. OpenAI clients: the URL as base URL. Ollama clients: "
                                f"{self.server.url.removesuffix('/v1')}. The model is '{model}'.")
        else:
            self.server.stop()
            self.url.clear()
            self.status.setText("Off.")
        self._show_queue(0)
        self.port.setEnabled(not on)
        self.copy.setEnabled(on)

    def _show_queue(self, busy: int) -> None:
        """The API's requests in the engine's batch and waiting for a place, and the limits on both."""
        if not self.server.running:
            self.queue.setText("")
            return
        limit, parallel = self.server.max_queue, self.server.parallel
        running = min(busy, parallel)
        now = "idle" if busy == 0 else f"{running} running, {busy - running} waiting"
        self.queue.setText(f"Requests: {now}. Up to {parallel} decode at once, taking turns token by token "
                           f"(the chat's replies go first); up to {limit} may be in, more are told when to retry "
                           "(Retry-After).")

    def on_event(self, event) -> None:
        changed = isinstance(event, p.TelemetrySnapshot) and (event.streams, event.sharing) != (self._streams,
                                                                                                 self._sharing)
        if changed:
            self._streams, self._sharing = event.streams, event.sharing
            self.dirty = True

    def render(self) -> None:
        lines = [_stream_line(stream) for stream in self._streams] if len(self._streams) > 1 or any(
            p.is_api_request(s.request_id) for s in self._streams) else []
        if lines and self._sharing is not None:
            lines.append(self._sharing.line())
        self.running.setText("\n".join(lines))

    def add_entry(self, entry) -> None:
        self.log.appendPlainText(entry.line())


def _stream_line(stream: p.StreamInfo) -> str:
    who = "chat" if not p.is_api_request(stream.request_id) else stream.request_id.removeprefix(p.API_REQUEST_PREFIX)[:8]
    if stream.state == "prefill":
        return f"{who}: reading its {stream.prompt_tokens}-token prompt"
    return f"{who}: {stream.tokens} tokens, {stream.decode_tokens_per_s:.1f} tok/s"
