"""A test hook on the native kernels: for tests and benchmarks only, never the engine.

The kernels pick their own code paths: the integer dots for a block type that has them, and AMX
tiles for a prompt's bf16 products where the CPU grants them; the engine's paths set the opt-in
8-bit inputs from their setting. A test that checks a path against its alternative, or a benchmark
that times both, forces one for the length of a `with` block. The default comes back on exit, also
when the block raises, so a failing test cannot leave the process on a path the engine never takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.decode.native.library import Kernels

# The kernels' own defaults (src/kernels/gemv.h, src/arch/x86/prompt_amx.h).
DEFAULT_INTEGER_DOTS = True
DEFAULT_AMX = True  # wanted: the tiles still run only where the CPU grants them
DEFAULT_INT8_INPUTS = False


@contextmanager
def forced_paths(kernels: Kernels, *, integer_dots: bool | None = None, amx: bool | None = None,
                 int8_inputs: bool | None = None) -> Iterator[Kernels]:
    """Run the block with the integer dots (False: the reference-exact float loops), AMX tiles and
    the 8-bit inputs switched as given (None leaves a switch alone), then back to the default."""
    try:
        if integer_dots is not None:
            kernels._set_integer_dots(integer_dots)
        if amx is not None:
            kernels._set_amx(amx)
        if int8_inputs is not None:
            kernels.use_int8_inputs(int8_inputs)
        yield kernels
    finally:
        if integer_dots is not None:
            kernels._set_integer_dots(DEFAULT_INTEGER_DOTS)
        if amx is not None:
            kernels._set_amx(DEFAULT_AMX)
        if int8_inputs is not None:
            kernels.use_int8_inputs(DEFAULT_INT8_INPUTS)
