"""CPU weight memory in 2 MiB pages (Linux transparent huge pages), where the kernel gives them.

A decode token streams every active weight once, hundreds of megabytes spread over many
matrices, most of a dense layer's well under 2 MiB. With 4 KiB pages every page costs a TLB miss
(a two-level walk in a VM) and the hardware prefetchers stop at each page's end; with 2 MiB pages
the same gemv reads measurably faster (docs/performance.md). Kernels with THP set to `madvise`
(the common default) only give huge pages to memory that asks, so the weights ask: an anonymous
private mapping, 2 MiB-aligned, advised MADV_HUGEPAGE before any page is touched. The expert pools
are such mappings; the dense weights are gathered into one (`gather`), so that small matrices
share huge pages. Anywhere else (no THP, not Linux) this is plain memory and nothing else changes.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np
import torch

from engine.system.memory import proc_bytes, release_free_heap

HUGE_PAGE = 2 << 20
WORTH_IT = HUGE_PAGE  # a smaller mapping could not hold a huge page


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


class Arena:
    """Tensors placed side by side in one huge-page-advised mapping: a model's many small dense
    matrices (a layer's attention projections, its router) share 2 MiB pages instead of each
    spanning 4 KiB ones. The mapping lives while any tensor placed in it does."""

    ALIGN = 64  # a cache line: every placed tensor starts on one

    def __init__(self, nbytes: int) -> None:
        self._bytes = empty_bytes(max(nbytes, 1))
        self._used = 0

    @classmethod
    def room_for(cls, nbytes: int) -> int:
        """What a tensor of `nbytes` takes in an arena, with its alignment."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` inside the arena."""
        start, end = self._used, self._used + tensor.nbytes
        if end > self._bytes.numel():
            raise ValueError(f"the arena has {self._bytes.numel() - start} bytes left, {tensor.nbytes} asked")
        self._used = start + self.room_for(tensor.nbytes)
        copy = self._bytes[start:end].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        return copy


GATHER_FROM = 4096  # smaller tensors (norm weights) sit in a page or two and in cache anyway
TRIM_EVERY = 256 << 20  # bytes moved between handing the freed originals' heap pages back


def gather(model: torch.nn.Module, skip: Iterable[torch.Tensor] = ()) -> int:
    """Move `model`'s contiguous CPU parameters and buffers of GATHER_FROM bytes or more (but
    `skip`) into one arena, in the order the modules list them, so a layer's weights lie side by
    side; tied tensors stay tied. Each old tensor is let go as its copy takes its place, and the
    heap pages of those freed are handed back every TRIM_EVERY bytes (glibc keeps them otherwise),
    so the load's peak grows by about that much, not by the model. Returns the bytes moved."""
    holders, room = _holders(model, {id(t) for t in skip})
    if not holders:
        return 0
    arena = Arena(room)
    moved = untrimmed = 0
    for places in holders.values():
        table, name = places[0]
        old = table[name]
        copy = arena.place(old.detach())
        new = torch.nn.Parameter(copy, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else copy
        for table, name in places:
            table[name] = new
        moved += old.nbytes
        untrimmed += old.nbytes
        del old  # its last reference here, unless the caller kept one
        if untrimmed >= TRIM_EVERY:
            release_free_heap()
            untrimmed = 0
    release_free_heap()
    return moved


def _holders(model: torch.nn.Module, skipped: set[int]) -> tuple[dict[int, list[tuple[dict, str]]], int]:
    """By tensor to gather: every (table, name) that holds it; and the arena room they need."""
    holders: dict[int, list[tuple[dict, str]]] = {}
    room = 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if (tensor is None or tensor.device.type != "cpu" or id(tensor) in skipped
                        or tensor.nbytes < GATHER_FROM or not tensor.is_contiguous() or tensor.layout != torch.strided):
                    continue
                if id(tensor) not in holders:
                    holders[id(tensor)] = []
                    room += Arena.room_for(tensor.nbytes)
                holders[id(tensor)].append((table, name))
    return holders, room


def huge_bytes_of_process() -> int:
    """AnonHugePages of this process (smaps_rollup), 0 where the kernel does not say."""
    return proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0
