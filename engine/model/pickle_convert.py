"""Opt-in conversion of a pickle checkpoint (`--allow-pickle`) to safetensors.

The user's folder is never written to: the converted copy lives in MoEScope's cache directory,
keyed by the source files' names, sizes and times, and is reused on the next load.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import platformdirs

_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def convert_pickle_checkpoint(root: Path, pickles: list[Path]) -> Path:
    import torch
    from safetensors.torch import save_file

    fingerprint = hashlib.sha256()
    for p in sorted(pickles):
        stat = p.stat()
        fingerprint.update(f"{p.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = Path(platformdirs.user_cache_dir("moescope")) / "converted" / fingerprint.hexdigest()[:16]
    done_marker = target / ".complete"
    if done_marker.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for index, source in enumerate(sorted(pickles)):
        # weights_only=True still refuses arbitrary objects; the user opted in to the rest.
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
        save_file(tensors, target / f"model-{index:05d}.safetensors")
    for name in _SIDE_FILES:
        if (root / name).exists():
            shutil.copy2(root / name, target / name)
    done_marker.touch()
    return target
