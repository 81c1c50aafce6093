"""The switch a loaded model's patched modules read: on only while a native decode step runs it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SWITCH_ATTR = "_moescope_switch"


class NativeSwitch:
    """On while a native decode step runs this model (one per loaded model)."""

    def __init__(self) -> None:
        self.on = False

    @contextmanager
    def active(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


def switched_on(module: torch.nn.Module) -> bool:
    """Whether `module`'s model is inside a native step now (False for a module never patched)."""
    switch = module.__dict__.get(SWITCH_ATTR)
    return switch is not None and switch.on
