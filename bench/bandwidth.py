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

    from engine.system import huge_pages

    if threads:
        torch.set_num_threads(threads)
    # In the memory the engine gives its weights (2 MiB pages where the kernel has them): read
    # through 4 KiB pages the same buffer is 2-5 % slower, and the limit must not flatter us.
    src = huge_pages.empty((nbytes // 4,), torch.float32)
    src.fill_(1.0)  # fault the pages in
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


def disk_random_read_bandwidth(files: list[Path], piece_bytes: int, limit_bytes: int = 512 << 20,
                               seed: int = 0) -> float:
    """Bytes/s reading `piece_bytes` pieces (one expert's size) at random offsets, pages dropped:
    the access pattern of any loader that fetches the experts a token happens to need. On this
    VM's virtual disk it is 2-3x below the sequential figure whatever the piece size or the
    number of threads (bench note in bench/decode_limit.py)."""
    import random

    rng = random.Random(seed)
    sizes = [(path, path.stat().st_size) for path in files if path.stat().st_size > piece_bytes]
    buf = bytearray(piece_bytes)
    view = memoryview(buf)
    done = 0
    fds = {path: os.open(path, os.O_RDONLY) for path, _ in sizes}
    try:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        while done < limit_bytes:
            path, size = rng.choice(sizes)
            offset = rng.randrange(0, size - piece_bytes) // 4096 * 4096
            got = 0
            while got < piece_bytes:
                n = os.preadv(fds[path], [view[got:]], offset + got)
                if n <= 0:
                    break
                got += n
            os.posix_fadvise(fds[path], offset, piece_bytes, os.POSIX_FADV_DONTNEED)
            done += got
        return done / (time.perf_counter() - start)
    finally:
        for fd in fds.values():
            os.close(fd)


def host_to_gpu_bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes/s from pinned host memory into the GPU (the link a RAM-store miss crosses on a CUDA
    device), median of `repeats` copies of one buffer."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # first touch: page mapping and context costs are not the link
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)
