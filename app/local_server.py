"""The window's "Local server": `engine.serve` on a thread, sharing the window's engine client.

Requests from the API (OpenAI's at `/v1`, Ollama's at `/api`) queue FIFO for a place in the engine's
batch, beside the chat (whose replies go ahead of them), and the panels show them live like chat
replies. Loopback only: the window never opens the model to other machines.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal

from app.engine_bridge import EngineBridge
from engine.errors import MoEScopeError


class LocalServer(QObject):
    request_logged = Signal(object)  # engine.serve.hub.LogEntry, on the GUI thread
    queue_changed = Signal(int)  # API requests waiting or running, the running one included
    _logged = Signal(object)  # emitted on the server's thread

    def __init__(self, bridge: EngineBridge, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.hub = None
        self.thread = None
        self.url = ""
        self._busy = 0  # the last count sent on queue_changed
        self._logged.connect(self.request_logged, Qt.ConnectionType.QueuedConnection)
        self.request_logged.connect(lambda _: self._note_queue())
        bridge.event.connect(self._on_event)

    @property
    def running(self) -> bool:
        return self.thread is not None

    def start(self, port: int) -> str | None:
        """Listen on 127.0.0.1:`port`; the reason when it cannot (the port is taken...), else None."""
        from engine.serve.app import create_app
        from engine.serve.hub import EngineHub
        from engine.serve.runner import ServerThread, listen

        self.stop()
        try:
            sock = listen("127.0.0.1", port)
        except MoEScopeError as exc:
            return str(exc)
        self.hub = EngineHub(self._send, on_log=self._logged.emit)
        if self.bridge.model is not None:
            self.hub.on_event(self.bridge.model)  # loaded before the server started
        self.thread = ServerThread(create_app(self.hub), sock)
        self.thread.start()
        self.url = self.thread.url
        return None

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        self.thread = self.hub = None
        self.url = ""
        self._note_queue()

    def _send(self, command) -> None:
        if not self.bridge.send(command):
            raise RuntimeError("the engine is not running")

    @property
    def max_queue(self) -> int:
        """How many API requests may wait or run at once (more are answered 429 with Retry-After); 0 when off."""
        return self.hub.max_queue if self.hub is not None else 0

    @property
    def parallel(self) -> int:
        """How many replies the engine decodes at once (1 before a model is loaded)."""
        model = self.bridge.model
        return max(1, getattr(model, "parallel", 1)) if model is not None else 1

    def _on_event(self, event) -> None:
        if self.hub is not None:
            self.hub.on_event(event)
            self._note_queue()

    def _note_queue(self) -> None:
        """Say the queue's length when it changed (a request's events arrive here; its end is logged)."""
        busy = self.hub.busy if self.hub is not None else 0
        if busy != self._busy:
            self._busy = busy
            self.queue_changed.emit(busy)
