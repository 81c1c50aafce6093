"""The physical limits measured in the same run: memory read bandwidth and the store's link."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes/s the memory system streams, on a buffer far larger than the caches.

    The larger of two measures, so the limit derived from it is never flattering: a float32 sum
    (pure reads) and a copy counted STREAM-style (bytes read + bytes written).
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    read = nbytes / best(src.sum)
    copy = 2 * nbytes / best(lambda: dst.copy_(src))
    return max(read, copy)


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
