"""The physical limits measured in the same run: memory read bandwidth and the store's link."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7, threads: int | None = None) -> float:
    """Bytes/s the memory system streams into the cores: a float32 sum over a buffer far larger
    than the caches, median of `repeats` passes.

    A decode step only reads weights, so a pure read is the limit that matters. (A STREAM-style
    copy, counted as read + write bytes, gave 48-85 GB/s across runs on the same 2-core VM: write
    allocation and the host's memory traffic make it unstable, so it is not used.) The median,
    because single passes on this shared VM occasionally run far faster than anything sustained
    (one of seven passes read 87 GB/s while its neighbours read 52).
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def disk_read_bandwidth(files: list[Path], limit_bytes: int = 1 << 30, chunk: int = 16 << 20) -> float:
    """Bytes/s reading checkpoint files the way the disk store does (pread, pages dropped after)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = 0
    start = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start cold, as the store sees it
            offset = 0
            while done < limit_bytes:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    break
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
                offset += n
                done += n
        finally:
            os.close(fd)
        if done >= limit_bytes:
            break
    return done / (time.perf_counter() - start)
