"""A safetensors file written one tensor at a time, in any order: the bytes `save_file` writes for
the same tensors, without ever holding them all.

Every tensor's dtype and shape are declared up front, so the header (and with it each tensor's
place in the file) is known before the first byte of data: each tensor is written at its own
offset as soon as it exists, and the written pages are flushed and dropped from the page cache
every `FLUSH_BYTES`, so neither this process nor the page cache (which a cgroup's memory limit
counts) holds more than that of the file at once.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

# torch dtype -> safetensors tag, for the dtypes a conversion writes
TAG_OF_TORCH = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
# safetensors' own order of its dtypes (the Rust `Dtype` enum): its writer lays tensors out by this
# order, largest first, then by name, and so must this one to write the same bytes
_TAG_RANK = {tag: rank for rank, tag in enumerate(
    ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
     "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"])}
HEADER_ALIGN = 8  # safetensors pads its header with spaces to a multiple of this
FLUSH_BYTES = 64 << 20  # written bytes after which they go to disk and leave the page cache

Spec = tuple[torch.dtype, tuple[int, ...]]


def header_bytes(specs: dict[str, Spec]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's first bytes (length, JSON header, padding) and each tensor's (start, end) in the
    data that follows, as safetensors lays them out."""
    order = sorted(specs, key=lambda name: (-_TAG_RANK[TAG_OF_TORCH[specs[name][0]]], name))
    header: dict[str, dict] = {}
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        end = offset + _numel(shape) * dtype.itemsize
        header[name] = {"dtype": TAG_OF_TORCH[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        spans[name] = (offset, end)
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text, spans


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class StreamedSafetensors:
    """Writes `path`; `write` each declared tensor once, then `close` (which checks that all were)."""

    def __init__(self, path: Path, specs: dict[str, Spec], flush_bytes: int = FLUSH_BYTES) -> None:
        self.path = Path(path)
        self._specs = specs
        head, self._spans = header_bytes(specs)
        self._data_start = len(head)
        self._pending: set[str] = set(specs)
        self._unflushed = 0
        self._flush_bytes = flush_bytes
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(head, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape = self._specs[name]
        if name not in self._pending or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"'{name}' is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {tuple(shape)}"
                             if name in self._pending else f"'{name}' written twice or never declared")
        start, _ = self._spans[name]
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._pwrite(memoryview(data), self._data_start + start)
        self._pending.discard(name)
        self._unflushed += data.nbytes
        if self._unflushed >= self._flush_bytes:
            self._drop_written()

    def close(self) -> None:
        """Flush and close; raises if a declared tensor was never written (the file is incomplete)."""
        if self._fd < 0:
            return
        try:
            if self._pending:
                raise ValueError(f"{len(self._pending)} declared tensors never written to {self.path}, "
                                 f"e.g. '{min(self._pending)}'")
            self._drop_written()
        finally:
            os.close(self._fd)
            self._fd = -1

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def _drop_written(self) -> None:
        # written pages are dirty: on disk first, else the kernel cannot drop them
        os.fdatasync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._unflushed = 0

    def __enter__(self) -> StreamedSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the error that stopped the writing is the one to see
            os.close(self._fd)
            self._fd = -1
            return
        self.close()
