"""Models other apps downloaded (LM Studio, Ollama): one entry per model file or checkpoint folder.

Each entry is opened where it lies: its `path` is what the loader gets (`--model PATH`), nothing is
copied. A file or folder that cannot be read is still an entry, with its problem in one line, so the
user sees why a model they have is not offered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.hub.estimate import SizeEstimate

SOURCES = {"cache": "HF cache", "lmstudio": "LM Studio", "ollama": "Ollama"}


@dataclass
class FoundModel:
    source: str  # lmstudio | ollama
    name: str  # as the app names it: publisher/repo/file, or model:tag
    path: Path  # what the loader opens: a .gguf file (the first of a split set), a blob, or a folder
    size_bytes: int
    quant: str = ""  # e.g. Q4_K_M, bf16
    estimate: SizeEstimate | None = None  # None when the files could not be read
    problem: str | None = None  # why the engine cannot run it, None when it can
    moe: bool = True  # False: a dense model (left out of the library)


def describe_gguf(source: str, name: str, path: Path) -> FoundModel:
    """A GGUF file (or split set) from its header; a file listed before and unchanged since is not read again."""
    from engine.hub.gguf_info import GGUFProblem, split_parts

    try:
        parts = tuple((part, part.stat().st_size, part.stat().st_mtime_ns) for part in split_parts(path))
        header, est = _sized_gguf(parts)
    except (GGUFProblem, OSError) as exc:
        return FoundModel(source, name, path, _size(path), problem=str(exc))
    return FoundModel(source, name, path, header.file_bytes, header.quant, est, est.problem,
                      moe=header.expert_count > 0)


@lru_cache(maxsize=256)
def _sized_gguf(parts: tuple[tuple[Path, int, int], ...]):
    """(header, estimate) of a GGUF, keyed on every part's size and time: a changed file is read again."""
    from engine.hub.gguf_info import estimate_gguf, read_header

    header = read_header(parts[0][0])
    return header, estimate_gguf(header)


def describe_folder(source: str, name: str, folder: Path) -> FoundModel:
    """A safetensors checkpoint folder (LM Studio keeps MLX-style models so), from its config.json."""
    from engine.errors import MoEScopeError
    from engine.hub.estimate import estimate_folder
    from engine.hub.supported import checkpoint_quant, config_problem, is_supported_config

    size = sum(_size(p) for p in folder.glob("*.safetensors"))
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return FoundModel(source, name, folder, size, problem=f"{folder / 'config.json'} is unreadable ({exc})")
    bits = (config.get("quantization") or {}).get("bits") if isinstance(config.get("quantization"), dict) else None
    quant = f"MLX {bits}-bit" if bits else checkpoint_quant(config)
    if bits:
        return FoundModel(source, name, folder, size, quant, problem="MLX-quantized weights are not supported by "
                          "MoEScope; use a GGUF or safetensors copy of this model")
    if not is_supported_config(config):
        return FoundModel(source, name, folder, size, quant, problem=config_problem(config), moe=False)
    try:
        est = estimate_folder(folder)
    except MoEScopeError as exc:
        return FoundModel(source, name, folder, size, quant, problem=str(exc))
    return FoundModel(source, name, folder, size, quant, est, est.problem)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
