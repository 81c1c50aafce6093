"""Experts in a block format: converted once from the checkpoint into MoEScope's cache folder,
then read like any checkpoint by the disk or RAM store.

The conversion writes one safetensors file per MoE layer (each expert's quantized matrices as
bytes, its biases in the compute dtype), streamed expert by expert so that its memory does not grow
with the model (`engine.model.safetensors_writer`), into `<key>.partial/`, then a manifest, and only then
renames the folder to `<key>`: a conversion that is killed midway leaves a `.partial` folder that
is never read, and is removed when the next conversion starts. The key holds the checkpoint's
fingerprint (its architecture: config and tensor shapes), the identity of the files the experts are
read from, the compute dtype and the format, so another model or format never reuses it; the user's
model folder is never written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from engine.errors import MoEScopeError
from engine.formats.blocks import BlockFormat
from engine.formats.dequantize import dequantize
from engine.formats.quantize import Quantizer, quantized_tensor, reference_quantizer
from engine.model.checkpoint import read_safetensors_header
from engine.model.conversion_cache import (
    MANIFEST,
    SOURCES,
    Sources,
    conversion_name,
    quantized_root,
    room_for,
    sources_of,
    sync,
)
from engine.model.dtypes import dtype_name, torch_dtype
from engine.model.layout import ExpertParam, ExpertPiece, MoELayout, quantized_params
from engine.model.safetensors_writer import Spec, StreamedSafetensors
from engine.offload.store import DiskStore
from engine.system.progress import ProgressFn

VERSION = 1


class DiskSpaceError(MoEScopeError):
    kind = "disk-full"


def quantize_layout(layout: MoELayout, fmt: BlockFormat, fingerprint: str, *, root: Path | None = None,
                    progress: ProgressFn | None = None,
                    quantizer: Quantizer = reference_quantizer) -> tuple[MoELayout, list[str]]:
    """`layout` with its experts stored in `fmt`, converted now (by `quantizer`: the runtime passes
    the native one, the same bytes) unless a finished conversion of this checkpoint to this format
    is in the cache folder already; and notes for the user."""
    params, slot_bytes, notes = quantized_params(layout.params, fmt)
    sources = sources_of({p.file for per_layer in layout.pieces for per_expert in per_layer for piece in per_expert
                          for p in (piece, piece.scales) if p is not None})  # few files, named by many pieces
    manifest = _manifest(layout, params, fmt, sources)
    folder = (root or quantized_root()) / conversion_name(fingerprint, sources, manifest["compute_dtype"], fmt.name)
    if not _finished(folder, manifest, layout.num_layers):
        _convert(layout, params, fmt, folder, manifest, progress, quantizer)
    pieces = _pieces(folder, layout, params)
    on_disk = sum(piece.nbytes for per_layer in pieces for per_expert in per_layer for piece in per_expert)
    return replace(layout, params=params, slot_bytes=slot_bytes, pieces=pieces, expert_format=fmt,
                   expert_bytes_on_disk=on_disk), notes


def _layer_file(folder: Path, layer: int) -> Path:
    return folder / f"moe-layer-{layer:04d}.safetensors"


def _name(expert: int, param: str) -> str:
    return f"expert-{expert}.{param}"


def _manifest(layout: MoELayout, params: list[ExpertParam], fmt: BlockFormat, sources: Sources) -> dict:
    return {"version": VERSION, "format": fmt.name, "compute_dtype": dtype_name(layout.compute_dtype),
            "layers": layout.num_layers, "experts": layout.num_experts,
            "params": [[p.name, list(p.shape), p.fmt.name if p.fmt else None, p.nbytes] for p in params],
            SOURCES: sources}


def _finished(folder: Path, manifest: dict, num_layers: int) -> bool:
    try:
        written = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return written == manifest and all(_layer_file(folder, layer).is_file() for layer in range(num_layers))


def _convert(layout: MoELayout, params: list[ExpertParam], fmt: BlockFormat, folder: Path, manifest: dict,
             progress: ProgressFn | None, quantizer: Quantizer = reference_quantizer) -> None:
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a conversion that was stopped: never trusted, redone
    shutil.rmtree(folder, ignore_errors=True)  # finished for another layout version: redone
    needed = sum(p.nbytes for p in params) * layout.num_experts * layout.num_layers
    fits, free, freed = room_for(folder.parent, needed)
    if freed and progress is not None:
        progress(0.0, f"removed {freed / 2**30:.2f} GiB of converted weights whose checkpoints changed or are gone")
    if not fits:
        raise DiskSpaceError(
            f"converting the experts to {fmt.name} needs {needed / 2**30:.2f} GiB in {folder.parent}, and "
            f"{free / 2**30:.2f} GiB is free; free some space there or keep the original format")
    partial.mkdir()
    source = DiskStore(layout)
    try:
        for layer in range(layout.num_layers):
            _convert_layer(source, layout, params, layer, _layer_file(partial, layer), quantizer)
            if progress is not None:
                progress((layer + 1) / layout.num_layers,
                         f"converting experts to {fmt.label}: MoE layer {layer + 1} of {layout.num_layers}")
        (partial / MANIFEST).write_text(json.dumps(manifest))
        sync(partial)
        os.replace(partial, folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise DiskSpaceError(f"cannot write the converted experts to {partial}: {exc.strerror or exc}") from None
    finally:
        source.close()


def _layer_specs(layout: MoELayout, params: list[ExpertParam]) -> dict[str, Spec]:
    """Each converted tensor of a layer file: quantized matrices as flat bytes, the rest as read."""
    original = {p.name: p for p in layout.params}
    return {_name(expert, p.name): (torch.uint8, (p.nbytes,)) if p.fmt is not None
            else (original[p.name].dtype, tuple(original[p.name].shape))
            for expert in range(layout.num_experts) for p in params}


def _convert_layer(source: DiskStore, layout: MoELayout, params: list[ExpertParam], layer: int, path: Path,
                   quantizer: Quantizer) -> None:
    """One MoE layer's file, streamed expert by expert: one source expert and one converted matrix in
    memory at a time, whatever the number or size of the experts (the file's bytes are save_file's)."""
    slot = torch.empty(layout.slot_bytes, dtype=torch.uint8)
    original = {p.name: p for p in layout.params}
    with StreamedSafetensors(path, _layer_specs(layout, params)) as out:
        for expert in range(layout.num_experts):
            source.fill(layer, expert, slot)
            for p in params:
                o = original[p.name]
                raw = slot[o.offset : o.offset + o.nbytes]
                if o.fmt is not None:  # a quantized checkpoint's blocks (MXFP4, FP8): their values first
                    matrix = dequantize(raw, o.fmt, o.rows_columns[1])
                else:
                    value = raw.view(o.dtype).view(o.shape)
                    if p.fmt is None:
                        out.write(_name(expert, p.name), value)
                        continue
                    matrix = value.t() if p.transposed else value  # quantized along its input features
                # the values as they are (bf16, fp16, float32): a quantizer widens them itself
                out.write(_name(expert, p.name), quantized_tensor(matrix, p.fmt, quantizer).reshape(-1))
            source.drop_cached()  # the expert's source pages, whole folios included


def _pieces(folder: Path, layout: MoELayout, params: list[ExpertParam]) -> list[list[list[ExpertPiece]]]:
    pieces: list[list[list[ExpertPiece]]] = []
    for layer in range(layout.num_layers):
        path = _layer_file(folder, layer)
        records = read_safetensors_header(path)
        per_layer = []
        for expert in range(layout.num_experts):
            per_expert = []
            for p in params:
                record = records[_name(expert, p.name)]
                per_expert.append(ExpertPiece(path, record.offset, record.nbytes, torch_dtype(record.dtype), p.name, 0))
            per_layer.append(per_expert)
        pieces.append(per_layer)
    return pieces
