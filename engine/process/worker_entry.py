"""The spawned engine process's entry point.

Kept free of torch at import time: the GUI process pickles a reference to `main` when it spawns
the worker, and must not import the engine's heavy modules to do so.
"""

from __future__ import annotations

from engine.system.process_settings import apply_process_settings  # torch-free


def main(conn) -> None:
    apply_process_settings()  # before the worker imports torch, let alone computes
    from engine.process.worker import Worker
    from engine.system.process_exit import exit_process

    Worker(conn).run()
    exit_process(0)
