"""The switch a loaded model's patched modules read: on only while a native decode step runs it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SWITCH_ATTR = "_moescope_switch"


class NativeSwitch:
    """On while a native decode step runs this model (one per loaded model). `rows` is on while a
    fast prompt runs it: then only the plain linears and routers take their rows through the native
    kernels (no per-length oneDNN kernel is made for them); every other module stays transformers'."""

    def __init__(self) -> None:
        self.on = False
        self.rows = False

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._set("on"):
            yield

    @contextmanager
    def prompt_rows(self) -> Iterator[None]:
        with self._set("rows"):
            yield

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
