"""The native kernels, for benchmarks that time them directly."""

from __future__ import annotations

import sys

from engine.decode.native.library import Kernels


def ready_kernels(threads: int) -> Kernels | None:
    """This machine's kernel variant, with torch set to `threads` threads; None where none loads
    (why printed to stderr)."""
    import torch

    from engine.decode.native import kernels as native

    kernels = native.load()
    if kernels is None:
        print(native.status(), file=sys.stderr)
        return None
    torch.set_num_threads(threads)
    return kernels
