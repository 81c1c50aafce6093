"""The native kernels, for benchmarks that time them directly."""

from __future__ import annotations

import sys
from types import ModuleType


def ready_kernels(threads: int) -> ModuleType | None:
    """This machine's kernel build, with torch set to `threads` threads; None where they cannot be
    built (the build's status printed to stderr)."""
    import torch

    from engine.decode.native import kernels as native

    kernels = native.wait(600)
    if kernels is None:
        print(native.status(), file=sys.stderr)
        return None
    torch.set_num_threads(threads)
    return kernels
