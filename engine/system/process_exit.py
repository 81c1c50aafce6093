"""Leaving a process without the interpreter's last garbage collection.

At exit the interpreter runs one more full collection over every object still alive: with torch,
transformers and a model loaded that walk takes seconds and frees nothing the exit does not return
anyway. Frozen objects are skipped by it. Torch-free, so the window's launcher uses it too.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """sys.exit(code), the final collection skipped. Only where the process ends: frozen objects are
    never collected again (atexit handlers and buffered files still run and flush)."""
    gc.freeze()
    sys.exit(code)
