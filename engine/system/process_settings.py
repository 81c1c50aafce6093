"""Settings for the whole process, made once by each entry point before anything computes.

The entry points that call `apply_process_settings` first: the engine CLI's `main` (every
`moescope` subcommand, `serve` among them), the spawned engine process (`engine.process.worker_entry`),
the demo's trainer and evaluator, every benchmark's `main`, and the tests' conftest. Importing an
engine module changes nothing in the process, so a program that uses the engine as a library calls
this itself if it wants the same settings.
"""

from __future__ import annotations

import os

# MKL's float32 products (torch's grouped_mm among them) take alignment-dependent paths on some CPUs
# (its AVX2 code): the same weights at another address give other last bits. In its strict
# reproducible mode a result no longer depends on where a slot lies, so `--exact` replies do not
# change with the budget's slot layout, and equal transformers' run in the same mode (the tests do).
MKL_REPRODUCIBLE = ("MKL_CBWR", "AUTO,STRICT")


def apply_process_settings() -> None:
    """Set the process-wide settings; safe to call again (a later call changes nothing).

    MKL reads MKL_CBWR once, at its first computing call (a matrix product), not when torch is
    imported: setting it before the first product is enough. A value the user set wins.
    """
    name, value = MKL_REPRODUCIBLE
    os.environ.setdefault(name, value)
