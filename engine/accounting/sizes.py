"""Parsing and printing byte sizes and budgets (`512MiB`, `2GiB`, `25%`, `all`, `64slots`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import BudgetError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class BudgetSpec:
    """A budget as the user wrote it, resolved against a model later.

    Exactly one of the fields is set: `everything`, `fraction` (of all expert bytes),
    `nbytes`, or `slots` (a total slot count, used by trace replay).
    """

    everything: bool = False
    fraction: float | None = None
    nbytes: int | None = None
    slots: int | None = None

    def resolve_bytes(self, all_expert_bytes: int, slot_bytes: int) -> int:
        if self.everything:
            return all_expert_bytes
        if self.fraction is not None:
            return int(all_expert_bytes * self.fraction)
        if self.slots is not None:
            return self.slots * slot_bytes
        assert self.nbytes is not None
        return self.nbytes

    def __str__(self) -> str:
        if self.everything:
            return "all"
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        if self.slots is not None:
            return f"{self.slots}slots"
        return format_bytes(self.nbytes or 0)


def parse_budget(text: str) -> BudgetSpec:
    """Parse `all`, `25%`, `64slots`, or a size such as `512MiB` / `2GiB` / `1.5GB`."""
    raw = text.strip().lower()
    if raw in ("all", "everything", "max"):
        return BudgetSpec(everything=True)
    if raw.endswith("%"):
        try:
            pct = float(raw[:-1])
        except ValueError:
            raise BudgetError(f"budget '{text}' is not a percentage; write e.g. 25%") from None
        if not 0 < pct <= 100:
            raise BudgetError(f"budget '{text}' must be between 0% and 100%")
        return BudgetSpec(fraction=pct / 100)
    if raw.endswith("slots") or raw.endswith("slot"):
        digits = raw.removesuffix("slots").removesuffix("slot").strip()
        if not digits.isdigit() or int(digits) <= 0:
            raise BudgetError(f"budget '{text}' needs a positive slot count, e.g. 64slots")
        return BudgetSpec(slots=int(digits))
    return BudgetSpec(nbytes=parse_size(text))


def parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise BudgetError(
            f"cannot read the size '{text}'; write e.g. 512MiB, 2GiB, 25% (of the expert bytes) or all"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
