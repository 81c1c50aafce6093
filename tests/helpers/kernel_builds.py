"""The kernel builds a test run needs, started when the run starts.

On a fresh machine each build flavour is a minute of compiling. Started at collection, on one
background thread, the compiler runs while the first tests (the window's, mostly waiting on engine
processes) do, instead of while a kernel test waits for it. One compiler at a time: on 2 cores two
would slow each other and the tests beside them.
"""

from __future__ import annotations

import platform
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

from engine.decode.native import kernels as native

_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-kernel-build")
_flavours: dict[str, Future] = {}


def start(flavours: tuple[str, ...] = ()) -> None:
    """Start the native build, then the other `flavours` in turn (x86-64 -march targets)."""
    native.start_build()
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    for flavour in flavours:
        if flavour not in _flavours:
            _flavours[flavour] = _pool.submit(_build_after_native, flavour)


def flavour(name: str) -> ModuleType | None:
    """The `name` build, waiting for it; None where the native build already is that flavour."""
    start((name,))
    return _flavours[name].result()


def _build_after_native(flavour: str) -> ModuleType | None:
    built = native.wait()
    if flavour == "avx2" and built is not None and built.code_path() == "avx2":
        return None  # the native build is it: nothing to build twice
    return native.compile_flavour(flavour)
