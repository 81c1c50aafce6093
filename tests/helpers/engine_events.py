"""Collecting a real worker's events in tests, with waits that end on the event, never on a timer."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.process.client import EngineClient


class EventLog:
    def __init__(self) -> None:
        self.events: list = []
        self._cond = threading.Condition()

    def __call__(self, event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[object], bool], timeout: float = 60.0, start: int = 0):
        """The first event from index `start` on that satisfies `predicate`; fails after `timeout`."""
        with self._cond:
            found = self._cond.wait_for(lambda: self._find(predicate, start) is not None, timeout)
            assert found, f"no matching event within {timeout}s; got {[type(e).__name__ for e in self.events[start:]]}"
            return self._find(predicate, start)

    def _find(self, predicate, start: int):
        return next((e for e in self.events[start:] if predicate(e)), None)

    def of(self, kind: type) -> list:
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def mark(self) -> int:
        with self._cond:
            return len(self.events)


def started_client() -> tuple[EngineClient, EventLog]:
    log = EventLog()
    client = EngineClient(log)
    client.start()
    return client, log
