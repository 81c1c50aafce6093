"""Starting and talking to the engine process, for the GUI, the tests and scripts.

No torch and no Qt here: the GUI wraps this in a thin QObject. Events are handed to a callback on
a background thread. When the worker dies (killed, segfault, out of memory), the client reports
an `Error` of kind `engine-crashed` and can restart it, reloading the last model.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from dataclasses import replace

from engine import protocol as p
from engine.process.worker_entry import main as worker_main

EventFn = Callable[[object], None]


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "the engine stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (probably out of memory)" if name == "SIGKILL" else ""
        return f"the engine was stopped by {name}{hint}"
    return f"the engine exited with code {exitcode}"


class EngineClient:
    def __init__(self, on_event: EventFn) -> None:
        self.on_event = on_event
        self.last_load: p.LoadModel | None = None
        self._ctx = mp.get_context("spawn")  # CUDA and Qt both dislike fork
        self._process = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=worker_main, args=(child,), name="moescope-engine", daemon=True)
        process.start()
        child.close()  # only the worker holds this end, so its death reads as end-of-file here
        self._stopping = False
        self._process, self._conn = process, parent
        self._reader = threading.Thread(target=self._read_loop, args=(process, parent), name="moescope-events",
                                        daemon=True)
        self._reader.start()

    def send(self, command) -> None:
        self._remember(command)
        with self._send_lock:
            if self._conn is None:
                raise RuntimeError("the engine is not started")
            with contextlib.suppress(BrokenPipeError, OSError):  # the reader thread reports the crash
                self._conn.send(command)

    def _remember(self, command) -> None:
        """What a restart reloads: the last load, with the live changes made since (a new object;
        the command the caller sent is left as it was)."""
        if isinstance(command, p.LoadModel):
            self.last_load = command
        elif self.last_load is None:
            return
        elif isinstance(command, p.SetBudget):
            self.last_load = replace(self.last_load, budget=command.budget)
        elif isinstance(command, p.SetPolicy):
            self.last_load = replace(self.last_load, policy=command.policy)
        elif isinstance(command, p.SetFastDecode):
            self.last_load = replace(self.last_load, fast_decode=command.enabled)
        elif isinstance(command, p.SetInt8Inputs):
            self.last_load = replace(self.last_load, int8_inputs=command.enabled)

    def restart(self, reload: bool = True) -> None:
        self._shutdown(graceful=False)
        self.start()
        if reload and self.last_load is not None:
            self.send(self.last_load)

    def stop(self, timeout: float = 5.0) -> None:
        self._shutdown(graceful=True, timeout=timeout)

    def _shutdown(self, graceful: bool, timeout: float = 5.0) -> None:
        process, conn = self._process, self._conn
        if process is None:
            return
        self._stopping = True
        if graceful and process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError), self._send_lock:
                conn.send(p.Shutdown())
            process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join(timeout)
        # The worker is gone, so the reader has read end-of-file (or is about to); then close our end.
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        conn.close()
        self._process = self._conn = self._reader = None

    def _read_loop(self, process, conn) -> None:
        while True:
            try:
                event = conn.recv()
            except (EOFError, OSError):
                break
            self.on_event(event)
        if self._stopping or process is not self._process:
            return
        process.join(1.0)
        self.on_event(p.Error("engine-crashed", describe_exit(process.exitcode) + "; restart it to go on", False))
