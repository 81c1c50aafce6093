"""Where weights converted to a block format are kept: MoEScope's cache folder, never the user's
model folder, each conversion keyed so that no other model, file or format can ever reuse it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import platformdirs

DISK_MARGIN = 64 << 20  # free space left over after writing a conversion, at least


def quantized_root() -> Path:
    return Path(platformdirs.user_cache_dir("moescope")) / "quantized"


def files_identity(files: Iterable[Path]) -> str:
    """The source files as they are now: each one's resolved path (in the Hugging Face cache, a
    content-named blob), size and modification time. A model's fingerprint names its architecture
    only, which a base model and its fine-tune share: keyed by it alone, the second would run on
    the first one's converted weights. A moved or rewritten checkpoint converts again."""
    digest = hashlib.sha256()
    for name in sorted({str(Path(file).resolve()) for file in files}):
        stat = os.stat(name)
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]


def sync(path: Path) -> None:
    """A file's bytes (or every file's in a folder) on disk before it is renamed into place."""
    for item in path.iterdir() if path.is_dir() else [path]:
        with open(item, "rb") as handle:
            os.fsync(handle.fileno())
