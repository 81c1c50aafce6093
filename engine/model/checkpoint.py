"""Finding and checking a checkpoint folder before anything is loaded.

Everything here reads headers only: a 100 GB checkpoint is checked in milliseconds.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import MODEL_ACCEPTS, CheckpointError, UnsafeCheckpointError
from engine.model.dtypes import TAG_SIZES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")



@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes sit on disk."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class CheckpointFiles:
    """A checked checkpoint folder: its config and every tensor's location."""

    root: Path
    config: dict
    tensors: dict[str, TensorRecord] = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def under(self, prefix: str) -> CheckpointFiles:
        """The tensors of one submodule (`prefix` without its dot), named as that submodule names them."""
        if not prefix:
            return self
        head = prefix + "."
        return CheckpointFiles(self.root, self.config,
                               {key[len(head):]: t for key, t in self.tensors.items() if key.startswith(head)})


def read_safetensors_header(path: Path) -> dict[str, TensorRecord]:
    """Read one file's header and check that the file really holds every byte it promises.

    A truncated download or a corrupt file is named here, before any tensor is read.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated or empty (no safetensors header); download it again")
            (header_len,) = struct.unpack("<Q", head)
            if header_len <= 0 or 8 + header_len > size:
                raise CheckpointError(f"{path} is corrupt or truncated (bad header length); download it again")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is corrupt (its header is not valid JSON); download it again") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupt (unexpected header); download it again")
    data_start = 8 + header_len
    records: dict[str, TensorRecord] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is corrupt (tensor '{name}' has no valid entry)") from None
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype not in TAG_SIZES or end - begin != numel * TAG_SIZES[dtype]:
            raise CheckpointError(f"{path} is corrupt (tensor '{name}' has inconsistent size)")
        if data_start + end > size:
            raise CheckpointError(
                f"{path} is truncated: it holds {size} bytes but tensor '{name}' ends at byte "
                f"{data_start + end}; the download was probably interrupted — download it again"
            )
        records[name] = TensorRecord(name, path, dtype, shape, data_start + begin, end - begin)
    return records


def _builtin_model_type(model_type: str | None) -> bool:
    """True when transformers ships this architecture: its own code is used and the repo's is never run."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(model_type) and model_type in CONFIG_MAPPING


def read_config(folder: Path) -> dict:
    """A checkpoint folder's config.json, or one line saying why it cannot be read."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"'{folder}' has no config.json; it is not a Hugging Face checkpoint folder")
    try:
        return json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{config_path} is not valid JSON") from None


def open_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> CheckpointFiles:
    """Check a checkpoint folder and index its safetensors files.

    Refuses pickle-only checkpoints (unless `allow_pickle`, which converts them, see `pickle_convert`)
    and models that need their own Python code (unless `trust_remote_code`).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"model path '{root}' does not exist; pass {MODEL_ACCEPTS}")
    if not root.is_dir():
        raise CheckpointError(f"model path '{root}' is a file; pass the folder that holds config.json, or a .gguf file")
    config = read_config(root)
    if config.get("auto_map") and not trust_remote_code and not _builtin_model_type(config.get("model_type")):
        raise UnsafeCheckpointError(
            f"'{root.name}' needs its own Python code (config.json has auto_map); MoEScope does not run "
            "downloaded code unless you pass --trust-remote-code after reading that code"
        )
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        pickles = [p for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles and not allow_pickle:
            raise UnsafeCheckpointError(
                f"'{root.name}' has only pickle weights ({pickles[0].name}); pickle files can run code when "
                "loaded, so they are refused — use a safetensors version of the model, or pass --allow-pickle "
                "if you trust the source"
            )
        if pickles:
            from engine.model.pickle_convert import convert_pickle_checkpoint

            return open_checkpoint(convert_pickle_checkpoint(root, pickles), trust_remote_code=trust_remote_code)
        raise CheckpointError(f"'{root}' has no weights (no .safetensors files)")
    files = CheckpointFiles(root=root, config=config)
    for shard in shards:
        files.tensors.update(read_safetensors_header(shard))
    return files
