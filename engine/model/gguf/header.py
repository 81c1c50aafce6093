"""Parsing a GGUF header (metadata and tensor table) from bytes, skipping the tokenizer's arrays.

The `gguf` package's GGUFReader turns every element of every metadata array into numpy views: for a
150k-token vocabulary and its merges that is hundreds of thousands of views per file (gguf 0.19):
too slow to list a folder of models, to size a file on the Hub from its first bytes, or to open one
for a chat (engine.model.gguf.file; the tokenizer's arrays are read by transformers). This walks
the same layout (GGUF v2/v3, see gguf/constants.py) with struct, keeping scalars and short numeric
arrays and stepping over strings and the rest; quant types and their block sizes come from the gguf
package.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
KEEP_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer head counts); longer ones skipped
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
LENGTH = struct.Struct("<Q")


class ShortHeader(Exception):
    """The bytes end inside the header: `need` bytes from the start would hold at least the next item."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class BadHeader(ValueError):
    pass


@dataclass
class ParsedHeader:
    metadata: dict[str, object]
    tensors: list[tuple[str, str, int, int, int]]  # name, quant type, elements, bytes, end offset in the file
    data_start: int
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per tensor, GGUF's order (columns first)


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ShortHeader(self.at + size)
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.at + length > len(self.buf):
            raise ShortHeader(self.at + length)
        start, self.at = self.at, self.at + length
        return bytes(self.buf[start:self.at]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, at, end, length = self.buf, self.at, len(self.buf), LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise ShortHeader(at + 8)
            at += 8 + length(buf, at)[0]
        if at > end:
            raise ShortHeader(at)
        self.at = at

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in SCALARS:
                size = struct.calcsize(SCALARS[item])
                if self.at + size * count > len(self.buf):
                    raise ShortHeader(self.at + size * count)
                if count > KEEP_ARRAY:
                    self.at += size * count
                    return None
                return [self.take(SCALARS[item]) for _ in range(count)]
            if item == STRING:  # the vocabulary and merges: stepped over, length by length
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        raise BadHeader(f"unknown metadata value type {kind}")


def parse_header(buf) -> ParsedHeader:
    """The header in `buf` (the file's first bytes, or all of it mapped). ShortHeader when it runs past
    the end of `buf`, BadHeader when it is not a GGUF header."""
    import gguf

    if len(buf) < 4:
        raise ShortHeader(24)
    if bytes(buf[:4]) != MAGIC:
        raise BadHeader("it does not begin with the GGUF magic bytes")  # the caller names the file
    cur = _Cursor(buf)
    cur.at = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise BadHeader(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = cur.string()
        value = cur.value(cur.take("<I"))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        kind, offset = cur.take("<I"), cur.take("<Q")
        infos.append((name, dims, kind, offset))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
    data_start = cur.at + (-cur.at % align)
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise BadHeader(f"tensor '{name}' has unknown quant type {kind}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_size
        tensors.append((name, qtype.name, elements, nbytes, data_start + offset + nbytes))
    return ParsedHeader(metadata, tensors, data_start, {name: tuple(dims) for name, dims, _, _ in infos})


def read_file_header(path) -> ParsedHeader:
    """The header of a local GGUF file, mapped (not read whole). ShortHeader when the file ends inside
    it, BadHeader when it is not a GGUF file or cannot be mapped."""
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:  # nothing of the header arrived (and mmap refuses it)
                raise ShortHeader(24)
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return parse_header(mapped)
    except OSError as exc:
        raise BadHeader(str(exc)) from None
