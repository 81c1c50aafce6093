"""Where every weight goes: dense tensors into the model, routed experts into the store.

The checkpoint's tensor names are mapped to the model's with transformers' own conversion
mapping (the same renamings and expert-merging rules `from_pretrained` applies), so every family
transformers knows is handled without per-model code here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from engine.errors import CheckpointError, NotMoEError
from engine.formats.blocks import BlockFormat, format_for, formats_that_fit
from engine.model.checkpoint import CheckpointFiles, TensorRecord
from engine.model.dtypes import torch_dtype

SLOT_ALIGN = 64  # bytes; keeps every expert matrix aligned for vector loads and DMA

# Only a fallback: the router module says its top-k (`router_top_k`).
TOPK_CONFIG_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token", "moe_k")
TOPK_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "moe_topk", "top_k_experts")
ROUTER_NAMES = ("gate", "router")  # transformers 5 keeps the router beside the experts module

@dataclass(frozen=True)
class ExpertParam:
    """One weight of an expert as the experts forward reads it (e.g. `gate_up_proj`, [2I, H]), and
    how its bytes sit in a slot: in the compute dtype, or quantized in a block format (`fmt`) as
    [rows, row bytes] with rows = output features (the module's [in, out] when `transposed`)."""

    name: str
    shape: tuple[int, ...]  # as the module reads it
    dtype: torch.dtype  # of the slot's bytes: the compute dtype, or uint8 when quantized
    offset: int  # bytes from the start of a slot
    nbytes: int
    fmt: BlockFormat | None = None
    transposed: bool = False  # the module reads it as [in, out] (x @ W)

    @property
    def rows_columns(self) -> tuple[int, int]:
        """The matrix as quantized: [output features, input features]."""
        rows, columns = self.shape[-2], self.shape[-1]
        return (columns, rows) if self.transposed else (rows, columns)

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """The shape of its bytes in a slot, in `dtype`."""
        if self.fmt is None:
            return self.shape
        rows, columns = self.rows_columns
        return (rows, self.fmt.row_bytes(columns))


@dataclass(frozen=True)
class ExpertPiece:
    """A contiguous run of checkpoint bytes that fills part of one expert parameter."""

    file: Path
    file_offset: int
    nbytes: int
    src_dtype: torch.dtype
    param: str
    dst_offset: int  # bytes from the start of that parameter, in the checkpoint dtype
    transposed_from: tuple[int, int] | None = None  # the matrix as stored, to transpose into the parameter


@dataclass
class MoELayout:
    """The model's mixture-of-experts geometry and where each expert's bytes live."""

    module_paths: list[str]  # the experts module of each MoE layer, in model order
    decoder_layers: list[int]  # decoder layer index of each MoE layer
    num_experts: int
    top_k: int
    params: list[ExpertParam]
    slot_bytes: int  # one expert, in compute dtype, aligned
    pieces: list[list[list[ExpertPiece]]]  # [moe layer][expert] -> pieces
    dense: dict[str, TensorRecord] = field(default_factory=dict)  # model key -> checkpoint tensor
    expert_bytes_on_disk: int = 0
    compute_dtype: torch.dtype = torch.float32
    expert_format: BlockFormat | None = None  # the block format the experts are stored in; None: compute dtype

    @property
    def quantized(self) -> bool:
        return self.expert_format is not None

    @property
    def num_layers(self) -> int:
        return len(self.module_paths)

    @property
    def all_expert_bytes(self) -> int:
        return self.slot_bytes * self.num_experts * self.num_layers

    @property
    def min_budget_bytes(self) -> int:
        # One token needs top_k experts of a layer at once; fewer slots would thrash within a token.
        return self.slot_bytes * self.top_k * self.num_layers

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for t in self.dense.values())


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for classes decorated with transformers' `@use_experts_implementation`."""
    return hasattr(module, "is_concatenated") and hasattr(module, "_is_expert_parallel")


def _router(model: torch.nn.Module, experts_path: str, num_experts: int) -> tuple[torch.nn.Module, int] | None:
    """The router (gate) of the MoE block whose experts module is at `experts_path`, a sibling named
    `gate` or `router` with a [experts, hidden] matrix (its own or a projection's), and the hidden size."""
    block = model.get_submodule(experts_path.rpartition(".")[0])
    for name in ROUTER_NAMES:
        module = getattr(block, name, None)
        if not isinstance(module, torch.nn.Module):
            continue
        for p in module.parameters():
            if p.dim() == 2 and p.shape[0] == num_experts:
                return module, int(p.shape[1])
    return None


def router_top_k(model: torch.nn.Module, experts_path: str, num_experts: int) -> int | None:
    """How many experts a token takes, as the router module knows it: its (or its MoE block's) top-k
    attribute, else the width of the expert indices it returns for one token (run on the meta device:
    no weight is read)."""
    block = model.get_submodule(experts_path.rpartition(".")[0])
    found = _router(model, experts_path, num_experts)
    for owner in (found[0] if found else None, block):
        for attr in TOPK_ATTRIBUTES:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= num_experts:
                return value
    if found is None:
        return None
    router, hidden = found
    dtype = next(router.parameters()).dtype
    for shape in ((1, hidden), (1, 1, hidden)):
        try:
            with torch.no_grad():
                out = router.forward(torch.zeros(shape, dtype=dtype, device="meta"))
        except Exception:  # a router that wants more than hidden states: the config decides
            continue
        indices = [t for t in (out if isinstance(out, tuple) else ()) if isinstance(t, torch.Tensor)
                   and not t.is_floating_point() and t.dtype != torch.bool]
        if len(indices) == 1 and 0 < indices[0].shape[-1] <= num_experts:
            return int(indices[0].shape[-1])
    return None


def top_k_of(model: torch.nn.Module, experts_path: str, num_experts: int) -> int:
    """The router's top-k; the config's keys only where the router does not tell."""
    return router_top_k(model, experts_path, num_experts) or find_top_k(model.config)


def find_top_k(config) -> int:
    for cfg in (config, getattr(config, "text_config", None)):
        for key in TOPK_CONFIG_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and value > 0:
                return value
    raise CheckpointError("cannot find the number of experts per token (top-k) in config.json")


def build_layout(model: torch.nn.Module, files: CheckpointFiles, compute_dtype: torch.dtype) -> MoELayout:
    """Map every checkpoint tensor to a dense model weight or to a piece of one expert."""
    experts = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not experts:
        arch = (files.config.get("architectures") or [files.config.get("model_type", "?")])[0]
        raise NotMoEError(
            f"'{files.root.name}' ({arch}) is a dense model, not a mixture-of-experts model; "
            "MoEScope offloads experts, so run dense models with a plain runner"
        )
    module_paths = [name for name, _ in experts]
    module_index = {name: i for i, name in enumerate(module_paths)}
    first = experts[0][1]
    num_experts = int(first.num_experts)
    params: list[ExpertParam] = []
    offset = 0
    transposed = bool(getattr(first, "is_transposed", False))
    for pname, p in first.named_parameters(recurse=False):
        shape = tuple(p.shape[1:])
        nbytes = p[0].numel() * compute_dtype.itemsize
        params.append(ExpertParam(pname, shape, compute_dtype, offset, nbytes, transposed=transposed and len(shape) == 2))
        offset += aligned(nbytes)
    for name, m in experts[1:]:
        other = [(n, tuple(p.shape[1:])) for n, p in m.named_parameters(recurse=False)]
        if other != [(p.name, p.shape) for p in params] or m.num_experts != num_experts:
            raise CheckpointError(f"experts of '{name}' differ in shape from the first MoE layer; not supported yet")
    param_by_name = {p.name: p for p in params}

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    pieces: list[list[list[ExpertPiece]]] = [[[] for _ in range(num_experts)] for _ in module_paths]
    dense: dict[str, TensorRecord] = {}
    expert_disk = 0

    for key, record in files.tensors.items():
        model_key, src_pattern = rename_source_key(
            key, renamings, converters, model.base_model_prefix, meta_state
        )
        if model_key not in meta_state and key in meta_state:
            # transformers' own fallback: a renaming that also hit a key it was not meant for (DeepSeek-V4's
            # `.norm.` -> `.kv_norm.` on the final norm) leaves the original name, which the model has
            model_key, src_pattern = rename_source_key(key, [], [], model.base_model_prefix, meta_state)
        owner, _, pname = model_key.rpartition(".")
        if owner in module_index and pname in param_by_name:
            expert_disk += record.nbytes
            layer = module_index[owner]
            target = param_by_name[pname]
            src_dtype = torch_dtype(record.dtype)
            transpose = _fused_transpose(converters, src_pattern)
            swapped = None
            if transpose is not None and not (transpose.check_dims and record.shape == (num_experts, *target.shape)):
                swapped = target.shape[::-1]  # like transformers, a `check_dims` transpose skips the model's shape
            if src_pattern is None or transpose is not None:  # fused [E, ...] tensor on disk: one slice per expert
                expected = (num_experts, *(swapped or target.shape))
                if record.shape != expected:
                    raise CheckpointError(f"tensor '{key}' has shape {record.shape}, expected {expected}")
                per_expert = record.nbytes // num_experts
                for e in range(num_experts):
                    pieces[layer][e].append(ExpertPiece(record.file, record.offset + e * per_expert, per_expert,
                                                        src_dtype, pname, 0, swapped))
            else:  # one tensor per expert, maybe one of several concatenated parts (gate, up)
                part, n_parts = _converter_part(converters, src_pattern, key)
                expert = _expert_index(key)
                numel = 1
                for dim in record.shape:
                    numel *= dim
                if numel * n_parts * compute_dtype.itemsize != target.nbytes or expert >= num_experts:
                    raise CheckpointError(f"tensor '{key}' does not fit expert parameter '{pname}' {target.shape}")
                pieces[layer][expert].append(
                    ExpertPiece(record.file, record.offset, record.nbytes, src_dtype, pname, part * record.nbytes)
                )
        elif src_pattern is not None:
            raise CheckpointError(
                f"'{key}' needs a weight conversion MoEScope does not support for dense weights yet"
            )
        else:
            dense[model_key] = record

    for layer, per_layer in enumerate(pieces):
        for e, expert_pieces in enumerate(per_layer):
            covered = {}
            for piece in expert_pieces:
                covered[piece.param] = covered.get(piece.param, 0) + piece.nbytes
            for p in params:
                want = p.nbytes // compute_dtype.itemsize
                have = covered.get(p.name, 0)
                src_size = expert_pieces[0].src_dtype.itemsize if expert_pieces else 1
                if have // src_size != want:
                    raise CheckpointError(
                        f"checkpoint is missing weights of expert {e} in '{module_paths[layer]}' ({p.name}); "
                        "the download may be incomplete"
                    )
    return MoELayout(
        module_paths=module_paths,
        decoder_layers=[_decoder_layer_index(name) for name in module_paths],
        num_experts=num_experts,
        top_k=top_k_of(model, module_paths[0], num_experts),
        params=params,
        slot_bytes=aligned(offset),
        pieces=pieces,
        dense=dense,
        expert_bytes_on_disk=expert_disk,
        compute_dtype=compute_dtype,
    )


def aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def quantized_params(params: list[ExpertParam], fmt: BlockFormat,
                     where: str = "expert weight") -> tuple[list[ExpertParam], int, list[str]]:
    """The expert matrices re-laid in `fmt` (biases and other vectors stay in the compute dtype),
    the slot size, and notes for matrices that take llama.cpp's fallback format because their input
    features are not whole blocks of `fmt`. A matrix no format fits is refused, naming it."""
    laid, offset, notes = [], 0, []
    for p in params:
        if len(p.shape) == 2:
            rows, columns = p.rows_columns
            chosen = format_for(fmt, columns)
            if chosen is None:
                fits = ", ".join(formats_that_fit(columns)) or "none of the block formats"
                raise CheckpointError(
                    f"{where} '{p.name}' has {columns} input features, not a whole number of {fmt.block}-element "
                    f"blocks, so it cannot be stored as {fmt.name}; formats that fit: {fits} (or original)")
            if chosen is not fmt:
                notes.append(f"{where} '{p.name}' has {columns} input features, not whole {fmt.block}-element blocks: "
                             f"stored as {chosen.name} instead of {fmt.name}, as llama.cpp's quantizer does")
            p = ExpertParam(p.name, p.shape, torch.uint8, offset, chosen.packed_bytes((rows, columns)), chosen,
                            p.transposed)
        else:
            p = ExpertParam(p.name, p.shape, p.dtype, offset, p.nbytes, None, p.transposed)
        laid.append(p)
        offset += aligned(p.nbytes)
    return laid, aligned(offset), notes


def _fused_transpose(converters: list[WeightConverter], src_pattern: str | None) -> Transpose | None:
    """The converter's operation when it is only a transpose of the last two dimensions of a fused
    [E, A, B] expert tensor (Qwen3-VL-MoE's experts are stored [E, B, A]); None otherwise."""
    conv = next((c for c in converters if src_pattern in c.source_patterns), None) if src_pattern else None
    ops = list(conv.operations) if conv is not None else []
    if len(ops) == 1 and isinstance(ops[0], Transpose) and {ops[0].dim0, ops[0].dim1} == {1, 2}:
        return ops[0]
    return None


def _converter_part(converters: list[WeightConverter], src_pattern: str, key: str) -> tuple[int, int]:
    """Which part of a concatenated expert weight this source pattern is, e.g. gate=0, up=1 of 2."""
    for conv in converters:
        sources = list(conv.source_patterns)
        if src_pattern in sources:
            ops = list(conv.operations)
            plain_merge = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            concat_ok = len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
            if not (plain_merge and concat_ok):
                raise CheckpointError(f"expert weight '{key}' uses a layout conversion MoEScope does not support yet")
            return sources.index(src_pattern), len(sources)
    raise CheckpointError(f"no conversion rule found for expert weight '{key}'")


def _expert_index(key: str) -> int:
    match = re.search(r"\.experts\.(\d+)\.", key)
    if not match:
        raise CheckpointError(f"cannot tell which expert '{key}' belongs to")
    return int(match.group(1))


def _decoder_layer_index(module_path: str) -> int:
    match = re.search(r"\.(\d+)\.", module_path)
    return int(match.group(1)) if match else 0
