"""Where a GGUF file's weights go: dense tensors into the model, routed experts into the store.

The routed experts sit in llama.cpp's fused tensors, `blk.N.ffn_{gate,up,down}_exps.weight` of
[experts, rows, row bytes]: one expert is a contiguous run of each, so the store reads it straight
from the file at its offset. The experts' quant type is kept, layer by layer, where MoEScope has a
kernel for it (`engine.formats.blocks.FORMATS`: the same bytes): llama.cpp's Q4_K_M gives some
layers' `ffn_down_exps` Q6_K and the others Q4_K, and each layer keeps its own (the slots are sized
for the widest, `MoELayout.layer_params` says what each layer holds). A tensor in a type without a
kernel, a layer whose gate and up come in two types, or float experts beside quantized layers are
converted once, per tensor, to the nearest format with a kernel (`gguf.convert`). Dense tensors are
named by the `gguf` package's own tensor-name map.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from engine.errors import CheckpointError
from engine.formats.blocks import FORMATS, BlockFormat, format_for
from engine.model.checkpoint import TensorRecord
from engine.model.gguf import mla as gguf_mla
from engine.model.gguf.file import GGUFModel, GGUFTensor
from engine.model.layout import (
    ExpertParam,
    ExpertPiece,
    MoELayout,
    add_fused_pieces,
    aligned,
    empty_pieces,
    expert_modules,
    find_top_k,
)

# The experts forward's parameters and the fused GGUF tensors that fill them, in order: gate rows then
# up rows, as transformers concatenates them. Matrices are [E, out, in] in the file whatever the
# module's orientation; biases [E, out].
EXPERT_SOURCES = {"gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                  "down_proj": ("ffn_down_exps.weight",),
                  "gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
                  "down_proj_bias": ("ffn_down_exps.bias",)}
# Architectures whose experts read gate and up rows in pairs (gate 0, up 0, gate 1, ...): llama.cpp's
# converter splits gpt-oss's interleaved `gate_up_proj` into ffn_gate/ffn_up, the store pairs them again.
PAIRED_GATE_UP = {"gpt-oss"}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
KERNEL_FORMATS = {fmt.ggml_type: fmt for fmt in FORMATS.values()}


@dataclass(frozen=True)
class Conversion:
    """A fused expert tensor whose bytes are converted once into `fmt`, to fill `param` of MoE layer
    `layer` from byte `dst` on."""

    tensor: GGUFTensor
    fmt: BlockFormat
    why: str
    layer: int
    param: str
    dst: int
    weave_dim: int | None = None  # as ExpertPiece.weave_dim


def _bits(type_name: str) -> float:
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return nbytes * 8 / block


def nearest_format(type_name: str, columns: int) -> BlockFormat | None:
    """The format with a kernel that keeps `type_name`'s precision at the fewest bits: the type itself
    when it has a kernel, else the smallest at least as many bits (8-bit at most); None for floats."""
    if type_name in FLOAT_TYPES:
        return None
    kernel = FORMATS.get(type_name.lower())
    if kernel is None:
        wanted = _bits(type_name)
        fitting = sorted((f for f in FORMATS.values() if f.fits(columns)), key=lambda f: f.bits)
        kernel = next((f for f in fitting if f.bits >= wanted), FORMATS["q8_0"])
    return format_for(kernel, columns)


def _choose(param: str, by_layer: list[list[GGUFTensor]], columns: int) -> tuple[list[BlockFormat | None], dict[str, str]]:
    """The format each layer keeps `param` in (None: floats, read as they are), and why each tensor
    that is not kept in its own type must be converted (by tensor name)."""
    every = sorted({t.type_name for tensors in by_layer for t in tensors})
    if all(t in FLOAT_TYPES for t in every):
        if len(every) > 1:
            raise CheckpointError(f"the experts' '{param}' come in {' and '.join(every)} in different layers; "
                                  "MoEScope reads float experts of one type only — convert the GGUF again")
        return [None] * len(by_layer), {}
    kernel = {t: nearest_format(t, columns) for t in every if t not in FLOAT_TYPES}
    widest = max(kernel.values(), key=lambda f: f.bits)
    formats: list[BlockFormat | None] = []
    why: dict[str, str] = {}
    for tensors in by_layer:
        types = sorted({t.type_name for t in tensors})
        fmt = max((kernel.get(t, widest) for t in types), key=lambda f: f.bits)  # float layers take the widest
        formats.append(fmt)
        for t in tensors:
            if t.type_name.lower() == fmt.name:
                continue
            if t.type_name in FLOAT_TYPES:
                why[t.name] = f"its layers come in {' and '.join(every)} and a slot holds blocks or floats, not both"
            elif t.type_name.lower() not in FORMATS:
                why[t.name] = f"MoEScope has no kernel for {t.type_name}"
            else:
                why[t.name] = f"one layer's gate and up come in {' and '.join(types)} and a slot holds one format per matrix"
    return formats, why


@dataclass
class _SlotPlan:
    """One expert's slot: its params (each as wide as its widest layer's format), the format each layer
    keeps each param in, and why each tensor not kept in its own type is converted."""

    params: list[ExpertParam] = field(default_factory=list)
    formats: dict[str, list[BlockFormat | None]] = field(default_factory=dict)  # param -> format per layer
    why_of: dict[str, str] = field(default_factory=dict)  # tensor name -> why it is converted
    size: int = 0  # bytes of the params, each aligned

    def layer_params(self, layers: int) -> dict[int, list[ExpertParam]]:
        """MoE layer -> its params where a layer keeps any in another format than `params` say."""
        layer_params = {}
        for layer in range(layers):
            own = [p if self.formats[p.name][layer] in (None, p.fmt) else
                   replace(p, fmt=self.formats[p.name][layer],
                           nbytes=self.formats[p.name][layer].packed_bytes(p.rows_columns))
                   for p in self.params]
            if own != self.params:
                layer_params[layer] = own
        return layer_params


@dataclass
class _Placed:
    """The experts' pieces as read from the GGUF, and the tensors to convert first."""

    pieces: list[list[list[ExpertPiece]]]
    conversions: list[Conversion] = field(default_factory=list)
    expert_tensors: set[str] = field(default_factory=set)  # names of the GGUF tensors that hold experts
    expert_disk: int = 0


def build_gguf_layout(model: torch.nn.Module, gguf_model: GGUFModel,
                      compute_dtype: torch.dtype) -> tuple[MoELayout, list[Conversion]]:
    """The MoE layout of a GGUF model, and the expert tensors to convert before the store reads them."""
    name = gguf_model.path.name
    module_paths, num_experts, model_params = expert_modules(model, compute_dtype, name, gguf_model.architecture)
    if not {p.name for p in model_params} <= set(EXPERT_SOURCES):
        raise CheckpointError(f"{name}: the experts of '{gguf_model.architecture}' are laid out in a way MoEScope "
                              "cannot read from a GGUF yet")
    blocks = [_block_index(path) for path in module_paths]
    plan = _plan_slot(gguf_model, blocks, num_experts, model_params, compute_dtype)
    placed = _place_experts(gguf_model, blocks, num_experts, plan)
    dense = _dense_records(model, gguf_model, placed.expert_tensors, set(module_paths))
    layout = MoELayout(
        module_paths=module_paths,
        decoder_layers=blocks,
        num_experts=num_experts,
        top_k=find_top_k(model.config),
        params=plan.params,
        slot_bytes=aligned(plan.size),
        pieces=placed.pieces,
        dense=dense,
        expert_bytes_on_disk=placed.expert_disk,
        compute_dtype=compute_dtype,
        expert_format=next((p.fmt for p in plan.params if p.fmt is not None), None),
        layer_params=plan.layer_params(len(blocks)),
    )
    return layout, placed.conversions


def _sources(gguf_model: GGUFModel, param: str, block: int) -> list[GGUFTensor]:
    """The fused tensors of block `block` that fill the experts' `param`, in order."""
    found = []
    for stem in EXPERT_SOURCES[param]:
        tensor = gguf_model.tensors.get(f"blk.{block}.{stem}")
        if tensor is None:
            raise CheckpointError(f"{gguf_model.path.name} has no tensor 'blk.{block}.{stem}'; the file is "
                                  "incomplete or was not written by llama.cpp's converter")
        found.append(tensor)
    return found


def _rows_columns(param: ExpertParam) -> tuple[int, int | None]:
    """A matrix's [output, input] features; a bias's outputs and no inputs."""
    return param.rows_columns if len(param.shape) == 2 else (param.shape[0], None)


def _plan_slot(gguf_model: GGUFModel, blocks: list[int], num_experts: int, model_params: list[ExpertParam],
               compute_dtype: torch.dtype) -> _SlotPlan:
    """Each expert param in the format its layers' tensors are kept in (the widest), at its offset in the slot."""
    plan = _SlotPlan()
    for mp in model_params:
        by_layer = [_sources(gguf_model, mp.name, block) for block in blocks]
        _check_shapes(gguf_model, mp, by_layer, num_experts)
        per_layer, why = _choose(mp.name, by_layer, _rows_columns(mp)[1] or 1)
        plan.why_of.update(why)
        param, plan.formats[mp.name] = _slot_param(mp, per_layer, plan.size, compute_dtype)
        plan.params.append(param)
        plan.size += aligned(param.nbytes)
    return plan


def _check_shapes(gguf_model: GGUFModel, mp: ExpertParam, by_layer: list[list[GGUFTensor]], num_experts: int) -> None:
    """Every tensor holds `num_experts` experts' share of `mp`'s rows, with its columns."""
    rows, columns = _rows_columns(mp)
    for t in (t for tensors in by_layer for t in tensors):
        if t.shape[0] != num_experts or t.shape[1] * len(EXPERT_SOURCES[mp.name]) != rows \
                or (columns is not None and t.shape[-1] != columns):
            raise CheckpointError(f"{gguf_model.path.name}: tensor '{t.name}' has shape {list(t.shape)}, which does "
                                  f"not fit {num_experts} experts of '{mp.name}' {list(mp.shape)}")


def _slot_param(mp: ExpertParam, per_layer: list[BlockFormat | None], offset: int,
                compute_dtype: torch.dtype) -> tuple[ExpertParam, list[BlockFormat | None]]:
    """`mp` at `offset` of the slot, in the widest of its layers' formats (floats and biases in the
    compute dtype), and the format each layer keeps it in."""
    rows, columns = _rows_columns(mp)
    widest = max((f for f in per_layer if f is not None), key=lambda f: f.bits, default=None)
    if widest is None or columns is None:
        return (ExpertParam(mp.name, mp.shape, compute_dtype, offset, mp.nbytes, transposed=mp.transposed),
                [None] * len(per_layer))
    return (ExpertParam(mp.name, mp.shape, torch.uint8, offset, widest.packed_bytes((rows, columns)), widest,
                        mp.transposed), per_layer)


def _place_experts(gguf_model: GGUFModel, blocks: list[int], num_experts: int, plan: _SlotPlan) -> _Placed:
    """Every layer's expert params as pieces of the file, or as conversions whose output the pieces read."""
    placed = _Placed(empty_pieces(len(blocks), num_experts))
    paired = gguf_model.architecture in PAIRED_GATE_UP
    for layer, block in enumerate(blocks):
        for param in plan.params:
            _place_param(placed, plan, layer, param, _sources(gguf_model, param.name, block), paired)
    return placed


def _place_param(placed: _Placed, plan: _SlotPlan, layer: int, param: ExpertParam, found: list[GGUFTensor],
                 paired: bool) -> None:
    """One layer's tensors of `param` (gate then up, or one), one after another in the parameter."""
    dst = 0
    # gate and up read as halves, then paired along the output features as the slot holds them
    weave_dim = None
    if paired and len(found) == 2:
        weave_dim = 1 if param.transposed and param.fmt is None else 0
    # a float matrix the module reads [in, out] is transposed from the file's [out, in]
    stored_as = param.rows_columns if param.transposed and param.fmt is None else None
    for tensor in found:
        placed.expert_tensors.add(tensor.name)
        placed.expert_disk += tensor.nbytes
        per_expert = tensor.nbytes // len(placed.pieces[layer])  # a list of pieces per expert
        if tensor.name in plan.why_of:  # its pieces will point into the converted file (gguf.convert)
            fmt = plan.formats[param.name][layer]
            placed.conversions.append(Conversion(tensor, fmt, plan.why_of[tensor.name], layer, param.name, dst,
                                                 weave_dim))
            dst += fmt.row_bytes(tensor.shape[-1]) * tensor.shape[1]
            continue
        add_fused_pieces(placed.pieces[layer], tensor.file, tensor.offset, per_expert,
                         FLOAT_TYPES.get(tensor.type_name, torch.uint8), param.name, dst, transposed_from=stored_as,
                         weave_dim=weave_dim)
        dst += per_expert


def _dense_records(model: torch.nn.Module, gguf_model: GGUFModel, expert_tensors: set[str],
                   expert_paths: set[str]) -> dict[str, TensorRecord]:
    """Model key -> the GGUF tensor that fills it, for every weight outside the experts."""
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gguf_model.architecture]
    names = gguf.get_tensor_name_map(arch, int(gguf_model.arch_value("block_count", 0)))
    dense: dict[str, TensorRecord] = {}
    for key in model.state_dict():
        owner = key.rpartition(".")[0]
        if owner in expert_paths:
            continue
        # the converter's own renaming (its ModelBase.modify_tensors) before the name map
        lookup = key.replace("e_score_correction_bias", "e_score_correction.bias")
        gguf_name = names.get_name(lookup, try_suffixes=(".weight", ".bias")) or ""
        # a bare parameter (gpt-oss's `sinks`) is written with ".weight" added by the converter
        tensor = gguf_model.tensors.get(gguf_name) or gguf_model.tensors.get(f"{gguf_name}.weight")
        parts = gguf_mla.split_parts(gguf_name, gguf_model.tensors)
        if parts is not None:
            tensor, dense[key + gguf_mla.V_B] = parts[0], _record(parts[1])
        if tensor is None:
            continue  # an LM head tied to the embedding, or missing: the loader names what stays empty
        dense[key] = _record(tensor)
    unused = set(gguf_model.tensors) - expert_tensors - {r.name for r in dense.values()}
    unused = {n for n in unused if not n.startswith("rope_")}  # llama.cpp's precomputed RoPE tables
    if unused:
        raise CheckpointError(f"{gguf_model.path.name}: tensor '{sorted(unused)[0]}' (and {len(unused) - 1} more) has "
                              "no place in the transformers model; this GGUF variant is not supported yet")
    return dense


def _record(tensor: GGUFTensor) -> TensorRecord:
    return TensorRecord(tensor.name, tensor.file, tensor.type_name, tensor.shape, tensor.offset, tensor.nbytes)


def _block_index(module_path: str) -> int:
    match = re.search(r"\.(\d+)\.", module_path)
    if match is None:
        raise CheckpointError(f"cannot tell which layer '{module_path}' is")
    return int(match.group(1))
