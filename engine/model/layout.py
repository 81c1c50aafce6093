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
from transformers.core_model_loading import Transpose, WeightConverter, WeightRenaming, rename_source_key

from engine.errors import CheckpointError, NotMoEError
from engine.formats.blocks import BlockFormat, format_for, formats_that_fit
from engine.model.checkpoint import CheckpointFiles, TensorRecord
from engine.model.conversions import DenseConversion, ExpertSource, expert_source, split_expert_list
from engine.model.dtypes import torch_dtype
from engine.model.prequantized import CheckpointQuantization, checkpoint_quantization

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
    dst_offset: int  # bytes from the start of that parameter, in the checkpoint dtype (in the slot when relayed)
    interleave_dim: int | None = None  # the parameter's rows sit interleaved in pairs along this dim on disk
    weave_dim: int | None = None  # the reverse: two halves on disk, paired along this dim of the slot's value
    transposed_from: tuple[int, int] | None = None  # the matrix as stored, to transpose into the parameter
    # A quantized checkpoint's own blocks (engine.model.prequantized): these bytes and `scales` are
    # laid into the slot's block format as they are read (engine.formats.relay, by `relay` kind).
    relay: str = ""
    scales: ExpertPiece | None = None
    shape: tuple[int, ...] = ()  # [rows, columns] of the relayed matrix
    scale_shape: tuple[int, ...] = ()

    @property
    def elements(self) -> int:
        """How many of the parameter's values these bytes hold."""
        if self.relay:
            return self.shape[0] * self.shape[1]
        return self.nbytes // self.src_dtype.itemsize


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
    conversions: dict[str, DenseConversion] = field(default_factory=dict)  # dense weights transformers converts
    dense_scales: dict[str, TensorRecord] = field(default_factory=dict)  # model key -> its scale (quantized checkpoints)
    checkpoint_quant: CheckpointQuantization | None = None
    expert_bytes_on_disk: int = 0
    compute_dtype: torch.dtype = torch.float32
    expert_format: BlockFormat | None = None  # the block format the experts are stored in; None: compute dtype
    # MoE layers whose experts are stored in other block formats than `params` say (a GGUF's
    # Q4_K_M gives some layers' down projections Q6_K, the others Q4_K): their own params, in
    # `params`' order and at its offsets, none larger. `params` (and `slot_bytes`) are the widest.
    layer_params: dict[int, list[ExpertParam]] = field(default_factory=dict)
    # experts modules whose weights are tied to an offloaded layer's (DiffusionGemma's encoder runs its
    # decoder's layers): path -> that MoE layer; they run on its slots, counted as its traffic
    twins: dict[str, int] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return self.expert_format is not None

    def experts_modules(self) -> list[tuple[str, int]]:
        """(path, MoE layer) of every experts module that runs on the cache: each layer's, then the twins."""
        return [*((path, layer) for layer, path in enumerate(self.module_paths)), *self.twins.items()]

    def params_at(self, layer: int) -> list[ExpertParam]:
        """The experts' params as MoE layer `layer` stores them."""
        return self.layer_params.get(layer, self.params)

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
        return sum(t.nbytes for t in self.dense.values()) + sum(c.nbytes for c in self.conversions.values())


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for classes decorated with transformers' `@use_experts_implementation`."""
    return hasattr(module, "is_concatenated") and hasattr(module, "_is_expert_parallel")


def offloaded_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules MoEScope offloads (paths, in model order): those of the model's main stack,
    the largest group of one shape. Experts of another shape (a vision tower's) stay in memory with the
    dense weights and run on transformers' own forward (engine.model.experts_registry)."""
    groups: dict[tuple, list[tuple[str, torch.nn.Module]]] = {}
    for path, m in model.named_modules():
        if is_experts_module(m):
            shapes = tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False))
            groups.setdefault((getattr(m, "num_experts", None), shapes), []).append((path, m))
    if not groups:
        return []
    main = max(groups.values(), key=lambda g: sum(p.numel() for _, m in g for p in m.parameters(recurse=False)))
    twins = tied_experts(model, main)
    return [(path, m) for path, m in main if path not in twins]


def tied_experts(model: torch.nn.Module, experts: list[tuple[str, torch.nn.Module]]) -> dict[str, str]:
    """Experts modules whose every weight transformers ties to the same-named weight of another one
    (`all_tied_weights_keys`, target -> source): twin path -> owner path. The checkpoint holds the
    owner's bytes only, and both run on them."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    paths = {path for path, _ in experts}
    twins: dict[str, str] = {}
    for path, module in experts:
        owners = set()
        for name, _ in module.named_parameters(recurse=False):
            owner, _, source_name = (tied.get(f"{path}.{name}") or "").rpartition(".")
            owners.add(owner if source_name == name and owner in paths and owner != path else None)
        if len(owners) == 1 and None not in owners:
            twins[path] = owners.pop()
    return twins


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


def expert_modules(model: torch.nn.Module, compute_dtype: torch.dtype, name: str,
                   arch: str) -> tuple[list[str], int, list[ExpertParam]]:
    """The experts modules (paths, in model order), the number of experts, and one expert's
    parameters laid out in a slot in `compute_dtype`; a dense model is refused."""
    experts = offloaded_experts(model)
    if not experts:
        raise NotMoEError(
            f"'{name}' ({arch}) is a dense model, not a mixture-of-experts model; "
            "MoEScope offloads experts, so run dense models with a plain runner"
        )
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
    return [path for path, _ in experts], num_experts, params


@dataclass(frozen=True)
class _NameMap:
    """transformers' conversion mapping of a model: checkpoint tensor names to the model's keys, and
    the converter (if any) that builds a model weight from them."""

    renamings: list[WeightRenaming]
    converters: list[WeightConverter]
    converter_of: dict[str, WeightConverter]  # source pattern -> its converter
    meta_state: dict[str, torch.Tensor]
    prefix: str

    @classmethod
    def of(cls, model: torch.nn.Module) -> _NameMap:
        transforms = get_model_conversion_mapping(model)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        return cls(renamings=[t for t in transforms if isinstance(t, WeightRenaming)], converters=converters,
                   converter_of={pattern: conv for conv in converters for pattern in conv.source_patterns},
                   meta_state=model.state_dict(), prefix=model.base_model_prefix)

    def model_key(self, lookup: str, key: str) -> tuple[str, str | None, WeightConverter | None]:
        """The model key checkpoint tensor `key` (looked up as `lookup`) fills, the source pattern it
        matched, and that pattern's converter."""
        model_key, src_pattern = rename_source_key(lookup, self.renamings, self.converters, self.prefix,
                                                   self.meta_state)
        converter = self.converter_of[src_pattern] if src_pattern is not None else None
        if model_key not in self.meta_state and key in self.meta_state:
            # transformers' own fallback: a renaming that also hit a key it was not meant for (DeepSeek-V4's
            # `.norm.` -> `.kv_norm.` on the final norm) leaves the original name, which the model has
            model_key, src_pattern = rename_source_key(key, [], [], self.prefix, self.meta_state)
            converter = None
        return model_key, src_pattern, converter


@dataclass
class _Placement:
    """Where a checkpoint's tensors go, filled in tensor by tensor: pieces of the offloaded experts
    (`paths`, each with `num_experts` of `params`), or dense weights."""

    paths: list[str]
    num_experts: int
    params: list[ExpertParam]
    quant: CheckpointQuantization | None
    pieces: list[list[list[ExpertPiece]]] = field(init=False)  # [moe layer][expert] -> pieces
    layer_of: dict[str, int] = field(init=False)  # experts module path -> MoE layer
    param_by_name: dict[str, ExpertParam] = field(init=False)
    dense: dict[str, TensorRecord] = field(default_factory=dict)
    conversions: dict[str, DenseConversion] = field(default_factory=dict)
    dense_scales: dict[str, TensorRecord] = field(default_factory=dict)
    relayed: set[str] = field(default_factory=set)  # expert params read from the checkpoint's own blocks
    expert_disk: int = 0

    def __post_init__(self) -> None:
        self.layer_of = {path: i for i, path in enumerate(self.paths)}
        self.param_by_name = {p.name: p for p in self.params}
        self.pieces = empty_pieces(len(self.paths), self.num_experts)

    def expert_param(self, model_key: str) -> tuple[int, ExpertParam] | None:
        """(MoE layer, expert parameter) of a model key inside an offloaded experts module."""
        owner, _, pname = model_key.rpartition(".")
        if owner in self.layer_of and pname in self.param_by_name:
            return self.layer_of[owner], self.param_by_name[pname]
        return None


def build_layout(model: torch.nn.Module, files: CheckpointFiles, compute_dtype: torch.dtype) -> MoELayout:
    """Map every checkpoint tensor to a dense model weight or to a piece of one expert."""
    arch = (files.config.get("architectures") or [files.config.get("model_type", "?")])[0]
    module_paths, num_experts, params = expert_modules(model, compute_dtype, files.root.name, arch)
    placed = _Placement(module_paths, num_experts, params, checkpoint_quantization(files.config))
    names = _NameMap.of(model)
    for key, record in files.tensors.items():
        _place_tensor(placed, names, files, key, record)
    _check_experts_complete(placed, compute_dtype)
    params, slot_bytes, expert_format = _slot_format(params, placed.relayed, placed.quant)
    return MoELayout(
        module_paths=module_paths,
        decoder_layers=[_decoder_layer_index(name) for name in module_paths],
        num_experts=num_experts,
        top_k=top_k_of(model, module_paths[0], num_experts),
        params=params,
        slot_bytes=slot_bytes,
        pieces=placed.pieces,
        dense=placed.dense,
        conversions=placed.conversions,
        dense_scales=placed.dense_scales,
        checkpoint_quant=placed.quant,
        expert_bytes_on_disk=placed.expert_disk,
        compute_dtype=compute_dtype,
        expert_format=expert_format,
        twins=_twin_layers(model, placed.layer_of),
    )


def _twin_layers(model: torch.nn.Module, layer_of: dict[str, int]) -> dict[str, int]:
    """Experts modules tied to an offloaded one: path -> the MoE layer whose slots they run on."""
    every = [(path, m) for path, m in model.named_modules() if is_experts_module(m)]
    return {path: layer_of[owner] for path, owner in tied_experts(model, every).items() if owner in layer_of}


def _place_tensor(placed: _Placement, names: _NameMap, files: CheckpointFiles, key: str,
                  record: TensorRecord) -> None:
    """One checkpoint tensor (with its scale, in a quantized checkpoint) into the experts or the dense weights."""
    quant = placed.quant
    if quant is not None and quant.is_scale(key):
        return  # read with the tensor it scales
    scale = _scale_of(quant, files, key, record)
    lookup = quant.weight_key(key) if scale is not None else key
    model_key, src_pattern, converter = names.model_key(lookup, key)
    model_key, listed_expert, converter = split_expert_list(converter, model_key, key, placed.num_experts)
    expert = placed.expert_param(model_key)
    if expert is not None and scale is not None:
        layer, target = expert
        placed.expert_disk += record.nbytes + scale.nbytes
        placed.relayed.add(target.name)
        _add_relayed(placed.pieces[layer], quant, key, record, scale, target, placed.num_experts,
                     expert_source(converter, src_pattern, key), listed_expert)
    elif expert is not None:
        layer, target = expert
        placed.expert_disk += record.nbytes
        _add_expert(placed.pieces[layer], key, record, target, converter, src_pattern, listed_expert)
    elif converter is not None:
        if model_key in names.meta_state:  # else an extra the model does not use, as in from_pretrained
            placed.conversions.setdefault(model_key, DenseConversion(model_key, converter)).sources.append(
                (src_pattern, record))
    else:
        placed.dense[model_key] = record
        if scale is not None:
            placed.dense_scales[model_key] = scale


def _scale_of(quant: CheckpointQuantization | None, files: CheckpointFiles, key: str,
              record: TensorRecord) -> TensorRecord | None:
    """The scale tensor of a quantized checkpoint's tensor; None for a tensor stored unquantized."""
    scale_name = quant.scale_of(key, record) if quant is not None else None
    if scale_name is None:
        return None
    scale = files.tensors.get(scale_name)
    if scale is None:
        raise CheckpointError(
            f"quantized tensor '{key}' has no scale '{scale_name}' in '{files.root.name}'; the download "
            f"may be incomplete, or this is not a {quant.method} checkpoint as config.json says")
    return scale


def _add_expert(pieces: list[list[ExpertPiece]], key: str, record: TensorRecord, target: ExpertParam,
                converter: WeightConverter | None, src_pattern: str | None, listed_expert: int | None) -> None:
    """One checkpoint tensor in the compute dtype's kind as pieces of a layer's experts: a fused
    [E, ...] tensor (transposed, or one part of the parameter), or one expert's part."""
    num_experts = len(pieces)
    src_dtype = torch_dtype(record.dtype)
    transpose = _fused_transpose(converter)
    if transpose is not None:  # a fused [E, ...] tensor stored with its matrices transposed
        swapped = None
        if not (transpose.check_dims and record.shape == (num_experts, *target.shape)):
            swapped = target.shape[::-1]  # like transformers, a `check_dims` transpose skips the model's shape
        expected = (num_experts, *(swapped or target.shape))
        if record.shape != expected:
            raise CheckpointError(f"tensor '{key}' has shape {record.shape}, expected {expected}")
        add_fused_pieces(pieces, record.file, record.offset, record.nbytes // num_experts, src_dtype, target.name,
                         transposed_from=swapped)
        return
    source = expert_source(converter, src_pattern, key)
    shape = record.shape[1:] if source.fused else record.shape
    fits = bool(shape) and (shape[0] * source.parts, *shape[1:]) == target.shape
    if not fits or (source.fused and record.shape[0] != num_experts):
        want = f"[{num_experts}, ...] " if source.fused else ""
        raise CheckpointError(f"tensor '{key}' has shape {record.shape}, which does not fit {want}"
                              f"expert parameter '{target.name}' {target.shape}")
    if source.fused:  # one [E, ...] tensor on disk: one slice per expert
        per_expert = record.nbytes // num_experts
        add_fused_pieces(pieces, record.file, record.offset, per_expert, src_dtype, target.name,
                         source.part * per_expert, interleave_dim=source.interleave_dim)
        return
    expert = _expert_index(key) if listed_expert is None else listed_expert  # one tensor per expert
    if expert >= num_experts:
        raise CheckpointError(f"tensor '{key}' is expert {expert}, and the model has {num_experts}")
    pieces[expert].append(ExpertPiece(record.file, record.offset, record.nbytes, src_dtype, target.name,
                                      source.part * record.nbytes, source.interleave_dim))


def empty_pieces(layers: int, num_experts: int) -> list[list[list[ExpertPiece]]]:
    """[moe layer][expert] -> pieces, none yet."""
    return [[[] for _ in range(num_experts)] for _ in range(layers)]


def add_fused_pieces(pieces: list[list[ExpertPiece]], file: Path, offset: int, per_expert: int,
                     src_dtype: torch.dtype, param: str, dst_offset: int = 0, **fields) -> None:
    """A fused [E, ...] tensor at `offset` of `file` as one piece per expert of a layer (`pieces`):
    expert e's `per_expert` bytes follow expert e - 1's. `fields`: ExpertPiece's layout fields."""
    for e, expert_pieces in enumerate(pieces):
        expert_pieces.append(ExpertPiece(file, offset + e * per_expert, per_expert, src_dtype, param, dst_offset,
                                         **fields))


def _check_experts_complete(placed: _Placement, compute_dtype: torch.dtype) -> None:
    """Every parameter of every expert filled to its last value; else the checkpoint is incomplete."""
    for layer, per_layer in enumerate(placed.pieces):
        for e, expert_pieces in enumerate(per_layer):
            covered = {}
            for piece in expert_pieces:
                covered[piece.param] = covered.get(piece.param, 0) + piece.elements
            for p in placed.params:
                if covered.get(p.name, 0) != p.nbytes // compute_dtype.itemsize:
                    raise CheckpointError(
                        f"checkpoint is missing weights of expert {e} in '{placed.paths[layer]}' ({p.name}); "
                        "the download may be incomplete"
                    )


def _slot_format(params: list[ExpertParam], relayed: set[str],
                 quant: CheckpointQuantization | None) -> tuple[list[ExpertParam], int, BlockFormat | None]:
    """The experts' params, slot size and block format: the compute dtype's, or the checkpoint's own
    blocks when its quantized experts are relayed into them."""
    if not relayed:
        return params, aligned(params[-1].offset + params[-1].nbytes), None
    matrices = {p.name for p in params if len(p.shape) == 2}
    if relayed != matrices:
        raise CheckpointError(f"expert weights {sorted(matrices - relayed)} are not {quant.method} quantized "
                              f"while {sorted(relayed)} are; mixed expert formats are not supported yet")
    params, slot_bytes, _ = quantized_params(params, quant.fmt, "quantized expert weight", fallback=False)
    return params, slot_bytes, quant.fmt


def _add_relayed(pieces: list[list[ExpertPiece]], quant: CheckpointQuantization, key: str, record: TensorRecord,
                 scale: TensorRecord, target: ExpertParam, num_experts: int, source: ExpertSource,
                 listed_expert: int | None = None) -> None:
    """One quantized checkpoint tensor (and its scale) as pieces of a layer's experts, laid into
    `quant.fmt`'s blocks when read: the fused [E, ...] tensor of all experts, or one expert's part."""
    data_dtype, scale_dtype = ("U8", "U8") if quant.method == "mxfp4" else ("F8_E4M3", "F32")
    if (record.dtype, scale.dtype) != (data_dtype, scale_dtype):
        raise CheckpointError(f"'{key}' ({record.dtype}) and its scale '{scale.name}' ({scale.dtype}) are not the "
                              f"{data_dtype} data and {scale_dtype} scales MoEScope reads in {quant.method} checkpoints")
    shape = quant.matrix_shape(record)
    rows, columns = target.rows_columns
    if source.interleave_dim is not None:
        raise CheckpointError(f"quantized expert weight '{key}' has rows interleaved on disk; MoEScope reads "
                              f"{quant.method} experts only with their rows in the model's order")
    if source.fused:
        experts, part, n_parts = num_experts, 0, 1
        if shape != (num_experts, rows, columns):
            raise CheckpointError(f"tensor '{key}' holds a {shape} weight, expected {(num_experts, rows, columns)}")
        indices = range(num_experts)
    else:
        part, n_parts = source.part, source.parts
        experts, indices = 1, [_expert_index(key) if listed_expert is None else listed_expert]
        if len(shape) != 2 or shape[0] * n_parts != rows or shape[1] != columns or indices[0] >= num_experts:
            raise CheckpointError(f"tensor '{key}' does not fit expert parameter '{target.name}' {target.shape}")
    if not quant.fmt.fits(columns):
        raise CheckpointError(f"quantized expert weight '{key}' has {columns} input features, not whole "
                              f"{quant.fmt.block}-element blocks of {quant.fmt.name}; not supported")
    part_rows = rows // n_parts
    data_bytes, scale_bytes = record.nbytes // experts, scale.nbytes // experts
    for i, expert in enumerate(indices):
        scales = ExpertPiece(scale.file, scale.offset + i * scale_bytes, scale_bytes, torch.uint8, target.name, 0)
        pieces[expert].append(ExpertPiece(
            record.file, record.offset + i * data_bytes, data_bytes, torch.uint8, target.name,
            part * quant.fmt.packed_bytes((part_rows, columns)), relay=quant.method, scales=scales,
            shape=(part_rows, columns), scale_shape=scale.shape[-2:]))


def aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def quantized_params(params: list[ExpertParam], fmt: BlockFormat, where: str = "expert weight",
                     fallback: bool = True) -> tuple[list[ExpertParam], int, list[str]]:
    """The expert matrices re-laid in `fmt` (biases and other vectors stay in the compute dtype),
    the slot size, and notes for matrices that take llama.cpp's fallback format because their input
    features are not whole blocks of `fmt`. A matrix no format fits is refused, naming it."""
    laid, offset, notes = [], 0, []
    for p in params:
        if len(p.shape) == 2:
            rows, columns = p.rows_columns
            chosen = format_for(fmt, columns) if fallback else (fmt if fmt.fits(columns) else None)
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


def _fused_transpose(converter: WeightConverter | None) -> Transpose | None:
    """The converter's operation when it is only a transpose of the last two dimensions of a fused
    [E, A, B] expert tensor (Qwen3-VL-MoE's experts are stored [E, B, A]); None otherwise."""
    ops = list(converter.operations) if converter is not None else []
    if len(ops) == 1 and isinstance(ops[0], Transpose) and {ops[0].dim0, ops[0].dim1} == {1, 2}:
        return ops[0]
    return None


def _expert_index(key: str) -> int:
    match = re.search(r"\.experts\.(\d+)\.", key)
    if not match:
        raise CheckpointError(f"cannot tell which expert '{key}' belongs to")
    return int(match.group(1))


def _decoder_layer_index(module_path: str) -> int:
    match = re.search(r"\.(\d+)\.", module_path)
    return int(match.group(1)) if match else 0
