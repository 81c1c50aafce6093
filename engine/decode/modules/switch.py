"""The switch a loaded model's patched modules read: on only while a native decode step runs it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SWITCH_ATTR = "_moescope_switch"


class NativeSwitch:
    """On while a native decode step runs this model (one per loaded model). `rows` is on while a
    fast prompt runs it: then only the plain linears and routers take their rows through the native
    kernels (no per-length oneDNN kernel is made for them); every other module stays transformers'.
    `int8_rows`: that prompt's Q4_K linears take their inputs rounded to 8 bits (opt-in, lossy)."""

    def __init__(self) -> None:
        self.on = False
        self.rows = False
        self.int8_rows = False

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._set("on"):
            yield

    @contextmanager
    def prompt_rows(self, int8: bool = False) -> Iterator[None]:
        self.int8_rows = int8
        try:
            with self._set("rows"):
                yield
        finally:
            self.int8_rows = False

    @contextmanager
    def _set(self, flag: str) -> Iterator[None]:
        setattr(self, flag, True)
        try:
            yield
        finally:
            setattr(self, flag, False)


def switched_on(module: torch.nn.Module) -> bool:
    """Whether `module`'s model is inside a native step now (False for a module never patched)."""
    switch = module.__dict__.get(SWITCH_ATTR)
    return switch is not None and switch.on
