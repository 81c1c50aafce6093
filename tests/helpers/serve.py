"""A real `moescope serve` in its own process for tests: started on a free loopback port, its console
lines collected, waits that end on a line (never on a timer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
START_S = 180.0  # the worker imports torch + transformers and loads the model: slow on a busy 2-core machine


class ServeProcess:
    def __init__(self, model: str, *extra: str, env: dict | None = None) -> None:
        self.args = [sys.executable, "-m", "engine.cli.main", "serve", "--model", model, "--port", "0", *extra]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = START_S) -> ServeProcess:
        self.process = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for(r"serving .* on (http://\S+)|error", timeout)
        match = re.search(r"on (http://\S+)", line)
        assert match, f"moescope serve did not start: {self.lines}"
        self.url = match.group(1)  # .../v1
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<exited>")
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0, start: int = 0) -> str:
        """The first console line from index `start` matching `pattern`."""
        regex = re.compile(pattern)

        def found() -> str | None:
            return next((line for line in self.lines[start:] if regex.search(line) or line == "<exited>"), None)

        with self._cond:
            assert self._cond.wait_for(found, timeout), f"no line matching {pattern!r} within {timeout}s: {self.lines}"
            return found()

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    @property
    def worker(self) -> psutil.Process:
        """The engine worker (the server's one child process that runs the model)."""
        children = [c for c in psutil.Process(self.process.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert children, "the server has no engine worker"
        return max(children, key=lambda c: c.create_time())  # after a restart, the newest

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def serve(model: str, *extra: str) -> ServeProcess:
    return ServeProcess(model, *extra).start()


def served(model: str, *extra: str):
    """A module-scoped fixture: `moescope serve` on `model` for the module's tests, stopped after them."""
    import pytest

    @pytest.fixture(scope="module")
    def server():
        process = serve(model, *extra)
        yield process
        process.stop()

    return server


def cli_generate(model: str, prompt: str, *extra: Sequence[str]) -> dict:
    """`moescope generate --json` in its own process (the same engine code, no server in between)."""
    import json

    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "--model", model, "--prompt", prompt,
                          "--json", *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=START_S, check=True)
    return json.loads(out.stdout)
