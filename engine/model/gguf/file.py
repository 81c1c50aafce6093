"""Opening a GGUF file (or a split `-00001-of-0000N.gguf` set) as llama.cpp's converter writes it:
its metadata, and where every tensor's bytes sit, checked before anything is read.

Headers only (engine.model.gguf.header walks them, stepping over the vocabulary), and the tensors'
bytes are read later, per expert, by the store (the file is never copied or written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CheckpointError
from engine.model.gguf.header import BadHeader, ShortHeader, read_file_header

SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its quant type and shape (rows first, as numpy reads it)."""

    name: str
    file: Path
    ggml_type: int  # gguf.GGMLQuantizationType
    type_name: str  # e.g. Q4_K, BF16
    shape: tuple[int, ...]  # [..., rows, columns]: GGUF's dimensions reversed
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFModel:
    """A checked GGUF model: the first file, every part, the metadata and every tensor."""

    path: Path
    parts: list[Path]
    metadata: dict[str, object] = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def arch_value(self, key: str, default=None):
        """`<architecture>.<key>` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def is_gguf(path: Path) -> bool:
    """A `.gguf` name, or a file that starts with GGUF's magic (Ollama's blobs have no suffix)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as handle:
            return path.is_file() and handle.read(4) == b"GGUF"
    except OSError:
        return False


def split_parts(path: Path) -> list[Path]:
    """Every file of the split set `path` belongs to (just `path` when it is not split), checked to exist."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['prefix']}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(
            f"'{path.name}' is part of a split GGUF set of {count} files, and {missing[0]} is missing from "
            f"{path.parent}; download every part into the same folder")
    return parts


def _read(part: Path, model: GGUFModel, *, first: bool) -> None:
    import gguf

    try:
        parsed = read_file_header(part)
    except ShortHeader:
        raise CheckpointError(f"{part} is truncated inside its header; download it again") from None
    except BadHeader as exc:
        raise CheckpointError(f"{part} is not a readable GGUF file: {exc}; download it again") from None
    if first:
        model.metadata.update(parsed.metadata)  # scalars, strings, short arrays; the vocabulary is the tokenizer's
    size = part.stat().st_size
    for name, type_name, _, nbytes, end in parsed.tensors:
        if end > size:
            raise CheckpointError(
                f"{part} is truncated: it holds {size} bytes but tensor '{name}' ends at byte {end}; the "
                "download was probably interrupted — download it again")
        model.tensors[name] = GGUFTensor(name, part, int(gguf.GGMLQuantizationType[type_name]), type_name,
                                         tuple(reversed(parsed.dims[name])), end - nbytes, nbytes)


def open_gguf(path: str | Path) -> GGUFModel:
    """Check a GGUF file (and the rest of its split set) and index its tensors."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file '{path}' does not exist")
    parts = split_parts(path)
    model = GGUFModel(path=parts[0], parts=parts)
    for i, part in enumerate(parts):
        _read(part, model, first=i == 0)
    if not model.tensors:
        raise CheckpointError(f"{path} holds no tensors; pass the GGUF file with the model's weights")
    return model
