"""A model's memory needs from its config.json alone, before anything is downloaded.

The model is built on the meta device (no memory, a second even for 46B parameters) and its
parameters are counted: those of `@use_experts_implementation` modules are experts, the rest is
dense. Bytes follow the engine's own rules (engine.model.layout): one expert is a slot of aligned
parameters in the compute dtype, and the minimum budget is top-k slots per MoE layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.errors import CheckpointError
from engine.formats.blocks import FP8, MXFP4, BlockFormat, format_for, format_name
from engine.hub.supported import config_problem, quantization_of
from engine.model.checkpoint import read_config
from engine.model.dtypes import dtype_name

CONTEXT_TOKENS = 4096  # the context the working-memory estimate assumes

# Stored bits per weight of quantized expert matrices in the checkpoint files (MXFP4: 4-bit values +
# one 8-bit scale per 32; FP8: 8 bits, one float32 scale per 128x128 tile).
QUANT_BITS = {"mxfp4": 4.25, "fp8": 8.0}
QUANTIZED_EXPERTS = {"mxfp4": MXFP4, "fp8": FP8}  # the blocks the engine keeps such experts in


@dataclass
class SizeEstimate:
    model_type: str
    architecture: str
    num_layers: int
    num_moe_layers: int
    num_experts: int  # per MoE layer
    top_k: int
    total_params: int
    expert_params: int  # every routed expert of every layer
    dense_params: int  # everything else: attention, embeddings, norms, routers, shared experts
    active_params: int  # what one token uses: dense + top-k experts per MoE layer
    embedding_params: int  # the input embedding (some published "active" counts leave it out)
    dtype: str  # the compute dtype the engine would use
    bytes_per_param: int
    dense_bytes: int
    expert_bytes: int  # all routed experts, unpadded
    bytes_per_expert: int  # one expert slot as the engine lays it out
    all_expert_bytes: int  # the `all` budget: a slot for every expert
    min_budget_bytes: int  # top-k slots per MoE layer
    kv_bytes_per_token: int
    download_bytes: int | None  # the weight files, when known (Hub sizes, local files, or computed)
    quantization: str | None = None
    problem: str | None = None  # why the engine cannot run it (yet), None when it can
    notes: list[str] = field(default_factory=list)
    expert_format: str = "original"  # the experts' bytes above are in this format (see `in_format`)
    expert_param_shapes: list[tuple[int, ...]] = field(default_factory=list)  # one expert's share of each parameter
    experts_transposed: bool = False  # the expert matrices are [in, out] (x @ W), as GPT-OSS's

    @property
    def runnable(self) -> bool:
        return self.problem is None

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * CONTEXT_TOKENS

    def in_format(self, fmt: BlockFormat | None) -> SizeEstimate | None:
        """The same model with its routed experts stored in `fmt` (None: as the checkpoint has them), laid
        out as the engine's quantized store lays them (engine.model.layout.quantized_params: matrices in
        the format or llama.cpp's fallback for their width, vectors in the compute dtype); None when a
        matrix fits neither."""
        if fmt is None or not self.expert_param_shapes:
            return self if fmt is None else None
        from engine.model.layout import aligned

        slot = 0
        for shape in self.expert_param_shapes:
            if len(shape) == 2:
                columns = shape[0] if self.experts_transposed else shape[1]
                chosen = format_for(fmt, columns)
                if chosen is None:
                    return None
                slot += aligned(chosen.packed_bytes((shape[0] * shape[1] // columns, columns)))
            else:
                slot += aligned(_numel(shape) * self.bytes_per_param)
        slot = aligned(slot)
        experts = self.num_experts * self.num_moe_layers
        return replace(self, expert_format=format_name(fmt), bytes_per_expert=slot, all_expert_bytes=slot * experts,
                       min_budget_bytes=slot * self.top_k * self.num_moe_layers,
                       expert_bytes=slot * experts, notes=list(self.notes))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def estimate_from_config(config: dict, *, weight_file_bytes: int | None = None) -> SizeEstimate:
    """Sizes from a config.json dict; `weight_file_bytes` (the safetensors files' total) when known."""
    from engine.accounting.sizes import format_bytes
    from engine.model.dtypes import resolve_dtype
    from engine.model.layout import SLOT_ALIGN, offloaded_experts, top_k_of

    model, cfg = _meta_model(config)
    dtype = resolve_dtype("auto", config)
    itemsize = dtype.itemsize
    named_experts = offloaded_experts(model)
    experts = [m for _, m in named_experts]
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    expert_params = sum(p.numel() for m in experts for p in m.parameters(recurse=False))
    expert_matrix_params = sum(p.numel() for m in experts for p in m.parameters(recurse=False) if p.dim() == 3)
    num_experts = slot = per_expert = top_k = 0
    problem = None
    if experts:
        first = experts[0]
        num_experts = int(getattr(first, "num_experts", 0) or next(first.parameters(recurse=False)).shape[0])
        slot = _slot_bytes(first, itemsize, SLOT_ALIGN)
        per_expert = expert_params // (num_experts * len(experts))
        try:
            top_k = top_k_of(model, named_experts[0][0], num_experts)
        except CheckpointError as exc:
            problem = str(exc)
    else:
        problem = "a dense model, not a mixture-of-experts model; MoEScope offloads experts"
    model_type = str(config.get("model_type"))
    quant = quantization_of(config)
    notes: list[str] = []
    problem = problem or config_problem(config)
    if quant:
        notes.append(f"experts stay {quant}; dense weights are counted in {dtype_name(dtype)}")
    dense = total - expert_params
    download = weight_file_bytes
    if download is None:
        download = _computed_file_bytes(total, expert_matrix_params, itemsize, quant)
    elif not quant and total:
        ratio = download / (total * itemsize)
        if not 0.9 <= ratio <= 1.1:
            notes.append(f"the weight files hold {format_bytes(download)}, the config describes "
                         f"{format_bytes(total * itemsize)} (extra layers, e.g. multi-token prediction, or another dtype)")
    try:
        embedding = model.get_input_embeddings().weight.numel()
    except (AttributeError, NotImplementedError):
        embedding = 0
    estimate = SizeEstimate(
        model_type=model_type,
        architecture=(config.get("architectures") or [type(model).__name__])[0],
        num_layers=int(getattr(cfg.get_text_config(), "num_hidden_layers", 0) or 0),
        num_moe_layers=len(experts),
        num_experts=num_experts,
        top_k=top_k,
        total_params=total,
        expert_params=expert_params,
        dense_params=dense,
        active_params=dense + top_k * per_expert * len(experts),
        embedding_params=embedding,
        dtype=dtype_name(dtype),
        bytes_per_param=itemsize,
        dense_bytes=(dense + _persistent_buffers(model)) * itemsize,
        expert_bytes=expert_params * itemsize,
        bytes_per_expert=slot,
        all_expert_bytes=slot * num_experts * len(experts),
        min_budget_bytes=slot * top_k * len(experts),
        kv_bytes_per_token=_kv_bytes_per_token(cfg, itemsize),
        download_bytes=download,
        quantization=quant,
        problem=problem,
        notes=notes,
        expert_param_shapes=[tuple(p.shape[1:]) for p in experts[0].parameters(recurse=False)] if experts else [],
        experts_transposed=bool(experts and getattr(experts[0], "is_transposed", False)),
    )
    kept = QUANTIZED_EXPERTS.get(quant or "")
    if kept is not None and estimate.runnable:  # the engine keeps these experts in the checkpoint's blocks
        in_format = estimate.in_format(kept)
        if in_format is None:
            estimate.problem = f"the {quant} expert matrices are not whole {kept.block}-element blocks"
        else:
            estimate = replace(in_format, expert_format="original")  # the checkpoint's own format
    return estimate


def _meta_model(config: dict):
    """Build the model with no memory. Only transformers' built-in classes, never downloaded code."""
    from accelerate import init_empty_weights
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from engine.model.model_class import model_class

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"this transformers does not know model type '{model_type}'; update transformers or pick another model"
        )
    clean = {k: v for k, v in config.items() if k != "auto_map"}
    try:
        cfg = CONFIG_MAPPING[model_type].from_dict(clean)
        with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
            warnings.simplefilter("ignore")
            model = model_class(cfg).cls._from_config(cfg)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"transformers cannot build a '{model_type}' causal LM from this config.json: {exc}") from None
    return model, cfg


def _slot_bytes(experts, itemsize: int, align: int) -> int:
    """One expert as engine.model.layout.build_layout lays it out: each parameter aligned, then the slot."""
    offset = 0
    for p in experts.parameters(recurse=False):
        offset += -(-(p[0].numel() * itemsize) // align) * align
    return -(-offset // align) * align


def _persistent_buffers(model) -> int:
    """Elements of persistent buffers (e.g. DeepSeek's router score bias): checkpoint tensors read as dense."""
    return sum(b.numel() for mod in model.modules() for name, b in mod._buffers.items()
               if b is not None and name not in mod._non_persistent_buffers_set)


def _computed_file_bytes(total: int, expert_matrices: int, itemsize: int, quant: str | None) -> int | None:
    if quant is None:
        return total * itemsize
    if quant == "fp8":  # every linear weight in FP8 (scales and norms are a rounding error)
        return total
    if quant in QUANT_BITS:  # expert matrices quantized, everything else (incl. expert biases) in bf16
        return int(expert_matrices * QUANT_BITS[quant] / 8) + (total - expert_matrices) * 2
    return None


def _kv_bytes_per_token(cfg, itemsize: int) -> int:
    """KV cache bytes per token (all layers), as transformers' cache stores it."""
    text = cfg.get_text_config()
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not layers or not heads:
        return 0
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    k_dim = v_dim = head_dim
    if getattr(text, "qk_nope_head_dim", None):  # MLA (DeepSeek): keys and values are cached decompressed
        k_dim = int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim)
        v_dim = int(text.v_head_dim)
        kv_heads = heads
    return layers * kv_heads * (k_dim + v_dim) * itemsize


def estimate_folder(folder: Path) -> SizeEstimate:
    """Sizes of a local checkpoint folder: its config plus the real size of its weight files."""
    config = read_config(folder)
    shards = [p for p in folder.glob("*.safetensors") if p.exists()]  # exists(): skips broken cache links
    return estimate_from_config(config, weight_file_bytes=sum(p.stat().st_size for p in shards) if shards else None)
