"""CPU weight memory in 2 MiB pages (Linux transparent huge pages), where the kernel gives them.

A decode token streams every active weight once, hundreds of megabytes spread over many
1-20 MB matrices. With 4 KiB pages each matrix start costs TLB misses (two-level walks in a VM);
with 2 MiB pages the same gemv reads measurably faster (docs/performance.md). Kernels
with THP set to `madvise` (the common default) only give huge pages to memory that asks, so the
weights ask: an anonymous private mapping, 2 MiB-aligned, advised MADV_HUGEPAGE before any page is
touched. Anywhere else (no THP, not Linux) this is plain memory and nothing else changes.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from engine.system.memory import proc_bytes

HUGE_PAGE = 2 << 20
WORTH_IT = HUGE_PAGE  # smaller tensors fit a few 4 KiB TLB entries anyway


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` in huge-page-advised memory. The mapping lives
    as long as the tensor (numpy keeps the mmap object alive; torch keeps the numpy array)."""
    if nbytes < WORTH_IT or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE  # a 2 MiB-aligned start, or the kernel cannot use huge pages
    return torch.from_numpy(whole[skip : skip + nbytes])


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return empty_bytes(nbytes).view(dtype).view(shape)


def rehome(tensor: torch.Tensor) -> torch.Tensor:
    """A huge-page copy of a CPU tensor big enough to gain from it; else the tensor itself."""
    if tensor.device.type != "cpu" or tensor.nbytes < WORTH_IT or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensor
    copy = empty(tuple(tensor.shape), tensor.dtype)
    copy.copy_(tensor)
    return copy


def huge_bytes_of_process() -> int:
    """AnonHugePages of this process (smaps_rollup), 0 where the kernel does not say."""
    return proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0
