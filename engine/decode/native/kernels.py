"""Native one-token kernels for `--fast-decode` (moe_decode.cpp beside this file), built on first use.

torch's own kernels stream expert-sized bf16 weights at about half the memory bandwidth for one
row (a thread-pool round trip per matrix, and oneDNN re-arranging plain weights on every call);
the native kernels run a whole MoE layer's experts in two passes at close to a plain read's speed
(bench/decode_limit.py). They are compiled for this CPU (-march=native) by torch's extension
builder, which needs a C++ compiler and ninja, once per machine into the user cache; the build runs
on a background thread, and until it is ready (or where it cannot be built) decode tokens run on
transformers' kernels (the decode-path chooser says why), so nothing waits and nothing breaks
without a compiler.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import platformdirs
import torch

SOURCE = Path(__file__).with_name("moe_decode.cpp")
LOAD_WAIT_S = 180.0  # a model loaded with fast decode waits this long for a build (usually well under)

_lock = threading.Lock()
_done = threading.Event()
_builder: threading.Thread | None = None
_kernels: ModuleType | None = None
_problem = ""  # why the kernels are unavailable, once a build failed


def _cpu_fingerprint() -> str:
    """What -march=native compiled for: a cached build must not run on a different CPU."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_fingerprint().encode())
    return f"moescope_decode_{digest.hexdigest()[:12]}"


def _build(cpp_extension: ModuleType) -> None:
    global _kernels, _problem
    try:
        name = _build_name()
        directory = Path(platformdirs.user_cache_dir("moescope")) / "kernels" / name
        directory.mkdir(parents=True, exist_ok=True)
        _kernels = cpp_extension.load(
            name, [str(SOURCE)], build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: decode keeps transformers' kernels
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _problem = f"native decode kernels unavailable ({first_line[:200]})"
    finally:
        _done.set()


def start_build() -> None:
    """Build (or load the cached build of) the kernels on a background thread; idempotent."""
    global _builder
    with _lock:
        if _builder is None:
            if platform.system() == "Windows":  # the build flags are GCC/Clang's
                _set_problem("native decode kernels are built for Linux and macOS only")
                return
            # Imported here, not on the thread: it pulls in setuptools, and imports racing the main
            # thread's (transformers' lazy modules) have failed with ModuleNotFoundError.
            from torch.utils import cpp_extension

            try:  # the pip `ninja` package puts its binary beside the interpreter, not always on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass

            _builder = threading.Thread(target=_build, args=(cpp_extension,), name="moescope-kernel-build",
                                        daemon=True)
            _builder.start()


def _set_problem(text: str) -> None:
    global _problem
    _problem = text
    _done.set()


def ready() -> ModuleType | None:
    """The kernels if they are built and loaded; None otherwise (never waits)."""
    return _kernels


def wait(timeout: float | None = None) -> ModuleType | None:
    """Start the build if needed and wait for it (tests, benchmarks); the kernels or None."""
    start_build()
    _done.wait(timeout)
    return _kernels


def failed() -> bool:
    """The build ended without kernels (no compiler, unsupported system...)."""
    return _done.is_set() and _kernels is None


def status() -> str:
    """One line for the user: ready, building, or why not."""
    if _kernels is not None:
        return "native decode kernels ready"
    if _done.is_set():
        return _problem
    if _builder is not None:
        return "native decode kernels are building (first use on this machine)"
    return "native decode kernels not built yet"
