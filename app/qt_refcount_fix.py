"""Work around PySide6/shiboken6 6.12 dropping a reference to None on CPython < 3.12.

Every call of a void Qt method (`label.setText(...)`, `widget.update()`, a Python `paintEvent`…)
through shiboken6 6.12.0 decrements None's reference count once without having incremented it.
Python 3.12+ made None immortal, so there it is harmless; on 3.11 a running window reaches zero
within seconds and the interpreter aborts ("none_dealloc: deallocating None"). PySide6 6.11.3
does not have the bug. Until a fixed release is pinned, give None (and the bools, to be safe) a
reference count no app session can exhaust, which is what 3.12's immortal objects do.
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
import sys

_HEADROOM = 1 << 40  # decrements per session can't come near this
_applied = False


def needs_fix() -> bool:
    if sys.version_info >= (3, 12) or platform.python_implementation() != "CPython":
        return False
    if importlib.util.find_spec("shiboken6") is None:
        return False
    import shiboken6

    return tuple(getattr(shiboken6, "__version_info__", (0, 0))[:2]) >= (6, 12)


def apply() -> bool:
    """Idempotent; True when the headroom was added (now or before)."""
    global _applied
    if _applied:
        return True
    if not needs_fix():
        return False
    for singleton in (None, True, False):
        # ob_refcnt is the first field of every object (Py_ssize_t) in CPython's non-debug builds.
        ctypes.c_ssize_t.from_address(id(singleton)).value += _HEADROOM
    _applied = True
    return True
