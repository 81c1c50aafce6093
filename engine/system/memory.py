"""This process's memory, as the kernel reports it."""

from __future__ import annotations

import resource
import sys


def proc_bytes(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes; None where there is no such file or line."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    On Linux, VmHWM belongs to this program's own address space; ru_maxrss would also count
    the parent's memory before exec (a process started from a big one would look big).
    """
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
