"""Where weights converted to a block format are kept: MoEScope's cache folder, never the user's
model folder, each conversion keyed so that no other model, file or format can ever reuse it.

Each conversion also records its source files (path, size, modification time). One whose sources
have changed or are gone can never be used again (its key would differ), so the next conversion
removes it before checking the free space: a model updated or deleted does not leave gigabytes
behind. Conversions without that record come from earlier versions, which keyed them otherwise,
and go the same way."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import platformdirs
from safetensors import SafetensorError, safe_open

DISK_MARGIN = 64 << 20  # free space left over after writing a conversion, at least
MANIFEST = "moescope-quantized.json"  # a converted-experts folder's, written last
SOURCES = "sources"  # the manifest's (or a converted file's metadata) record of its source files

Sources = list[list]  # [[resolved path, size, mtime_ns], ...]


def quantized_root() -> Path:
    return Path(platformdirs.user_cache_dir("moescope")) / "quantized"


def sources_of(files: Iterable[Path]) -> Sources:
    """The source files as they are now: each one's resolved path (in the Hugging Face cache, a
    content-named blob), size and modification time, sorted."""
    record = []
    for name in sorted({str(Path(file).resolve()) for file in files}):
        stat = os.stat(name)
        record.append([name, stat.st_size, stat.st_mtime_ns])
    return record


def files_identity(files: Iterable[Path]) -> str:
    """A short digest of `sources_of(files)`."""
    return identity_of(sources_of(files))


def identity_of(sources: Sources) -> str:
    """A short digest of a sources record. A model's fingerprint names its architecture only,
    which a base model and its fine-tune share: keyed by it alone, the second would run on the
    first one's converted weights. A moved or rewritten checkpoint converts again."""
    digest = hashlib.sha256()
    for name, size, mtime in sources:
        digest.update(f"{name}:{size}:{mtime};".encode())
    return digest.hexdigest()[:12]


def conversion_name(fingerprint: str, sources: Sources, dtype_label: str, what: str) -> str:
    """A conversion's name in the cache folder: the model's architecture, its files, the compute
    dtype and what was converted to which format."""
    return f"{fingerprint[:20]}-{identity_of(sources)}-{dtype_label}-{what}"


def room_for(folder: Path, needed: int) -> tuple[bool, int, int]:
    """Make `folder`, remove the stale conversions beside it, and say whether `needed` bytes fit
    with the margin left over: (fits, free bytes, bytes freed)."""
    folder.mkdir(parents=True, exist_ok=True)
    freed = prune_stale(folder)
    free = shutil.disk_usage(folder).free
    return needed + DISK_MARGIN <= free, free, freed


def sync(path: Path) -> None:
    """A file's bytes (or every file's in a folder) on disk before it is renamed into place."""
    for item in path.iterdir() if path.is_dir() else [path]:
        with open(item, "rb") as handle:
            os.fsync(handle.fileno())


def prune_stale(root: Path | None = None) -> int:
    """Remove the finished conversions that can never be used again; returns the bytes freed.
    Unfinished ones (`.partial`) are left to the conversion of their own key: another process
    may be writing them."""
    root = root or quantized_root()
    freed = 0
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name.endswith(".partial") or not _is_conversion(entry) or _still_valid(entry):
            continue
        size = _size(entry)
        try:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError:
            continue  # in use or not ours to remove: it stays, and nothing depends on it going
        freed += size
    return freed


def _is_conversion(entry: Path) -> bool:
    return (entry / MANIFEST).is_file() if entry.is_dir() else entry.name.endswith(".safetensors")


def _recorded_sources(entry: Path) -> Sources | None:
    try:
        if entry.is_dir():
            return json.loads((entry / MANIFEST).read_text()).get(SOURCES)
        with safe_open(entry, framework="pt") as handle:
            recorded = (handle.metadata() or {}).get(SOURCES)
        return json.loads(recorded) if recorded is not None else None
    except (OSError, ValueError, SafetensorError):
        return None


def _still_valid(entry: Path) -> bool:
    recorded = _recorded_sources(entry)
    if not recorded:
        return False
    try:
        return sources_of(Path(name) for name, _, _ in recorded) == recorded
    except OSError:  # a source is gone
        return False


def _size(entry: Path) -> int:
    if entry.is_file():
        return entry.stat().st_size
    return sum(item.stat().st_size for item in entry.rglob("*") if item.is_file())
