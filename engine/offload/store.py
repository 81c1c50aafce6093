"""The expert store: every expert's bytes, outside compute memory.

Two tiers:
- `DiskStore` reads an expert straight from the safetensors files with `pread` and then tells the
  kernel to drop those pages (`POSIX_FADV_DONTNEED`), so the data does not linger in the page cache
  and the memory budget stays honest: the process holds dense weights + the cache, nothing more.
- `RamStore` holds all experts in host RAM (pinned when CUDA is used, so copies to the GPU are
  asynchronous DMA), already laid out as slots.

Both fill a host buffer laid out exactly like a cache slot (see `engine.model.layout.ExpertParam`).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from engine.formats import relay
from engine.model.conversions import undo_interleave, weave_halves
from engine.model.layout import ExpertPiece, MoELayout
from engine.system.progress import ProgressFn


class ExpertStore(ABC):
    kind: str

    def __init__(self, layout: MoELayout) -> None:
        self.layout = layout

    @abstractmethod
    def fill(self, layer: int, expert: int, slot: torch.Tensor) -> int:
        """Write one expert into `slot` (a host uint8 tensor of `slot_bytes`); return bytes read."""

    def fill_param(self, layer: int, expert: int, param_name: str, slot: torch.Tensor) -> int:
        """Write one weight matrix of an expert into its place in `slot` (loads move in such chunks)."""
        p = next(p for p in self.layout.params_at(layer) if p.name == param_name)
        host = self.host_view(layer, expert)
        if host is None:
            raise NotImplementedError(f"{type(self).__name__} cannot fill one parameter at a time")
        slot[p.offset : p.offset + p.nbytes].copy_(host[p.offset : p.offset + p.nbytes])
        return p.nbytes

    def host_view(self, layer: int, expert: int) -> torch.Tensor | None:
        """The expert's slot image already in host memory, if this store keeps one."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class DiskStore(ExpertStore):
    kind = "disk"

    def __init__(self, layout: MoELayout) -> None:
        super().__init__(layout)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._params = {p.name: p for p in layout.params}
        # The parameters whose bytes need converting to the compute dtype, transposing or re-pairing (a
        # GGUF file's pieces may differ by layer; a quantized checkpoint's relayed pieces are laid into
        # blocks instead); the others are read straight into the slot.
        self._converted = {p.param for per_layer in layout.pieces for per_expert in per_layer for p in per_expert
                           if not p.relay and (p.src_dtype != self._params[p.param].dtype
                                               or p.transposed_from is not None or p.weave_dim is not None
                                               or p.interleave_dim is not None)}

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def fill(self, layer: int, expert: int, slot: torch.Tensor) -> int:
        return sum(self.fill_param(layer, expert, p.name, slot) for p in self.layout.params)

    def fill_param(self, layer: int, expert: int, param_name: str, slot: torch.Tensor) -> int:
        pieces = [p for p in self.layout.pieces[layer][expert] if p.param == param_name]
        if pieces and pieces[0].relay:
            return sum(self._fill_relayed(piece, slot) for piece in pieces)
        if param_name not in self._converted:
            raw = slot.numpy()
            for piece in pieces:
                start = self._params[piece.param].offset + piece.dst_offset
                _pread_exact(self._fd(piece.file), raw[start : start + piece.nbytes], piece.file_offset)
            return sum(p.nbytes for p in pieces)
        # The checkpoint's dtype, row order or orientation differs from the slot's: read, then convert into
        # the slot.
        param = self._params[param_name]
        staging = torch.empty(param.nbytes // param.dtype.itemsize, dtype=pieces[0].src_dtype)
        raw = staging.view(torch.uint8).numpy()
        for piece in pieces:
            _pread_exact(self._fd(piece.file), raw[piece.dst_offset : piece.dst_offset + piece.nbytes], piece.file_offset)
        stored_as = pieces[0].transposed_from
        value = staging.view(stored_as).t() if stored_as is not None else staging.view(param.slot_shape)
        if pieces[0].interleave_dim is not None:
            value = undo_interleave(value, pieces[0].interleave_dim)
        if pieces[0].weave_dim is not None:
            value = weave_halves(value, pieces[0].weave_dim)
        slot[param.offset : param.offset + param.nbytes].view(param.dtype).view(param.slot_shape).copy_(value)
        return sum(p.nbytes for p in pieces)

    def _fill_relayed(self, piece: ExpertPiece, slot: torch.Tensor) -> int:
        """A quantized checkpoint's data and scales, read and laid into the slot's blocks. The data is
        read into the tail of its own place in the slot and relaid forward in bounded chunks, so a load
        needs no expert-sized temporaries (they would come back as resident memory with every miss)."""
        param = self._params[piece.param]
        start = param.offset + piece.dst_offset
        out = slot[start : start + param.fmt.packed_bytes(piece.shape)]
        data = out[out.numel() - piece.nbytes :]
        scales = torch.empty(piece.scales.nbytes, dtype=torch.uint8)
        _pread_exact(self._fd(piece.file), data.numpy(), piece.file_offset)
        _pread_exact(self._fd(piece.scales.file), scales.numpy(), piece.scales.file_offset)
        if piece.relay == "mxfp4":
            relay.mxfp4_from_openai(data.view(-1, 16), scales, out)
        else:
            relay.fp8_from_tiles(data.view(piece.shape), scales.view(torch.float32).view(piece.scale_shape), out)
        return piece.nbytes + piece.scales.nbytes

    def drop_cached(self) -> None:
        """Drop the page cache of every file this store has read. Each read drops its own range, but
        the kernel keeps a large folio that a range covers only in part, and tensors do not start on
        folio boundaries: a long run of reads (a conversion) would leave much of each file cached,
        which a cgroup's memory limit counts."""
        with self._lock:
            fds = list(self._fds.values())
        if hasattr(os, "posix_fadvise"):
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class RamStore(ExpertStore):
    kind = "ram"

    def __init__(self, layout: MoELayout, *, pin: bool, progress: ProgressFn | None = None) -> None:
        super().__init__(layout)
        shape = (layout.num_layers, layout.num_experts, layout.slot_bytes)
        self.buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        disk = DiskStore(layout)
        try:
            total = layout.num_layers * layout.num_experts
            for layer in range(layout.num_layers):
                for expert in range(layout.num_experts):
                    disk.fill(layer, expert, self.buffer[layer, expert])
                if progress:
                    done = (layer + 1) * layout.num_experts
                    progress(done / total, f"experts of MoE layer {layer + 1}/{layout.num_layers} into RAM")
        finally:
            disk.close()

    def fill(self, layer: int, expert: int, slot: torch.Tensor) -> int:
        slot.copy_(self.buffer[layer, expert])
        return self.layout.slot_bytes

    def host_view(self, layer: int, expert: int) -> torch.Tensor:
        return self.buffer[layer, expert]


def _pread_exact(fd: int, dest, offset: int) -> None:
    """Read exactly len(dest) bytes at `offset` into the writable buffer `dest`, then drop the pages."""
    view = memoryview(dest).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
