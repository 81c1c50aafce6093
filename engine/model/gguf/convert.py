"""GGUF expert tensors converted once into a format with a kernel, in MoEScope's cache folder.

Each converted tensor is one file, [experts, rows, row bytes] in its new format, written as
`<name>.partial` and renamed into place only when whole, so a conversion killed midway is redone,
never trusted. The folder's key holds the GGUF file's name, size and the formats, so another file
or version never reuses it; the GGUF file itself is only read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import platformdirs
import torch

from engine.errors import CheckpointError
from engine.model.gguf.file import GGUFModel
from engine.model.gguf.layout import Conversion
from engine.model.layout import ExpertPiece, MoELayout
from engine.system.progress import ProgressFn


def converted_root() -> Path:
    return Path(platformdirs.user_cache_dir("moescope")) / "gguf-converted"


def _folder(gguf_model: GGUFModel, conversions: list[Conversion], root: Path | None) -> Path:
    key = json.dumps([[p.name, p.stat().st_size] for p in gguf_model.parts]
                     + [[c.tensor.name, c.tensor.type_name, c.fmt.name] for c in conversions])
    return (root or converted_root()) / f"{gguf_model.path.stem[:40]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _convert_tensor(conversion: Conversion, out: Path) -> None:
    import gguf

    from engine.formats.quantize import quantize

    t, fmt = conversion.tensor, conversion.fmt
    experts, rows, columns = t.shape[0], t.shape[1], t.shape[-1]
    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    source = np.memmap(t.file, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
    per_expert = t.nbytes // experts
    partial = out.with_name(out.name + ".partial")
    try:
        with open(partial, "wb") as handle:
            for e in range(experts):
                raw = np.asarray(source[e * per_expert : (e + 1) * per_expert])
                values = _floats(raw, t.type_name) if t.type_name in ("F32", "F16", "BF16") else \
                    gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
                handle.write(quantize(np.asarray(values, dtype=np.float32).reshape(rows, columns), fmt).tobytes())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write converted experts to {out.parent}: {exc.strerror or exc}") from None
    finally:
        del source


def _floats(raw: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float32 if type_name == "F32" else np.float16).astype(np.float32)


def convert_experts(layout: MoELayout, gguf_model: GGUFModel, conversions: list[Conversion], *,
                    root: Path | None = None, progress: ProgressFn | None = None) -> list[str]:
    """Convert (once) the tensors `conversions` name and add their pieces to `layout`; notes for the user."""
    if not conversions:
        return []
    folder = _folder(gguf_model, conversions, root)
    folder.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(conversions):
        out = folder / f"{c.tensor.name}.{c.fmt.name}"
        if not out.is_file():
            if progress is not None:
                progress(i / len(conversions), f"converting {c.tensor.name} ({c.tensor.type_name}) to {c.fmt.label}")
            _convert_tensor(c, out)
        per_expert = c.fmt.packed_bytes((c.tensor.shape[1], c.tensor.shape[-1]))
        for e in range(layout.num_experts):
            layout.pieces[c.layer][e].append(ExpertPiece(out, e * per_expert, per_expert, torch.uint8, c.param, c.dst,
                                                             weave_dim=c.weave_dim))
    notes: dict[str, list[str]] = {}
    for c in conversions:
        notes.setdefault(f"{c.tensor.type_name} to {c.fmt.name.upper()} ({c.why})", []).append(c.tensor.name)
    return [f"{len(names)} expert tensor{'s' if len(names) > 1 else ''} converted once from {what} into {folder}, e.g. '{names[0]}'"
            for what, names in notes.items()]
