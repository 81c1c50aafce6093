"""What /proc/cpuinfo says about this machine's CPU (Linux; elsewhere nothing)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpuinfo_field(key: str) -> str:
    """The first processor's `key` in /proc/cpuinfo (e.g. "flags", "vendor_id"); "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""
