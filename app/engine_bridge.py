"""The engine process seen from Qt: `EngineClient` events re-emitted as a signal on the GUI thread.

The client calls back on its reader thread; the bridge hops to the GUI thread through a queued
connection, so every slot connected to `event` runs on the GUI thread and may touch widgets.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine import protocol as p

ClientFactory = Callable[[Callable[[object], None]], object]


def _default_client(on_event: Callable[[object], None]):
    from engine.process.client import EngineClient  # torch-free: the worker imports the heavy modules

    return EngineClient(on_event)


class EngineBridge(QObject):
    event = Signal(object)  # every protocol event, on the GUI thread
    _incoming = Signal(object)  # emitted on the client's reader thread

    def __init__(self, client_factory: ClientFactory | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._incoming.connect(self._deliver, Qt.ConnectionType.QueuedConnection)
        self._local_factory = client_factory or _default_client
        self.client = self._local_factory(self._incoming.emit)
        self.remote = ""  # the server's URL while the engine is a remote server (engine.remote)
        self.pid: int | None = None
        self.model: p.ModelLoaded | None = None
        self.budget_bytes: int | None = None
        self.policy: str | None = None
        self.crashed = False

    # ----- commands -----
    def start(self) -> None:
        self.crashed = False
        self.client.start()

    def send(self, command) -> bool:
        """False when there is no engine to send to (it crashed, or was never started)."""
        try:
            self.client.send(command)
        except RuntimeError:
            return False
        return True

    def load(self, path: str, budget: str = "all", policy: str | None = None, *, expert_format: str = "original",
             dense_format: str = "original", exact: bool = False, int8_inputs: bool = False) -> None:
        self.model = None
        if self.remote:  # back from a remote server to MoEScope's own engine
            self._switch(self._local_factory)
            self.remote = ""
            self.start()
        self.send(p.LoadModel(path=path, budget=budget, policy=policy or "lru", expert_format=expert_format,
                              dense_format=dense_format, fast_decode=not exact, int8_inputs=int8_inputs))

    def connect_remote(self, url: str, api_key: str | None, model: str) -> None:
        """Chat with an OpenAI-compatible server instead of the local engine (stopped until a model is loaded)."""
        from engine.remote.client import RemoteClient, RemoteTarget

        target = RemoteTarget(url, api_key or None, model)
        self.model = None
        self._switch(lambda on_event: RemoteClient(on_event, target))
        self.remote = target.base
        self.start()

    def _switch(self, factory: ClientFactory) -> None:
        self.client.stop()
        self.client = factory(self._incoming.emit)

    def set_exact(self, exact: bool) -> None:
        self.send(p.SetFastDecode(not exact))

    def set_int8_inputs(self, on: bool) -> None:
        self.send(p.SetInt8Inputs(on))

    def restart(self) -> None:
        """A new worker, reloading the last model with the budget, policy and kernels in force."""
        self.crashed = False
        self.model = None
        self.client.restart(reload=True)

    def stop(self) -> None:
        self.client.stop()

    @property
    def alive(self) -> bool:
        return bool(self.client.alive)

    @property
    def last_load(self) -> p.LoadModel | None:
        return self.client.last_load

    # ----- events -----
    @Slot(object)
    def _deliver(self, event) -> None:
        if isinstance(event, p.EngineStarted):
            self.pid = event.pid
        elif isinstance(event, p.ModelLoaded):
            self.model, self.budget_bytes, self.policy = event, event.budget_bytes, event.policy
        elif isinstance(event, p.BudgetChanged):
            self.budget_bytes = event.budget_bytes
        elif isinstance(event, p.PolicyChanged):
            self.policy = event.policy
        elif isinstance(event, p.Error) and event.kind == "engine-crashed":
            self.crashed = True
        self.event.emit(event)
