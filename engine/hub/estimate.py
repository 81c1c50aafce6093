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
# replies decoded at once, at most, when the engine chooses (engine.process.batch): more gain little on a
# CPU, where their experts stop overlapping
PARALLEL_MAX = 4

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
    hidden_size: int = 0
    vocab_size: int = 0
    # an input embedding the LM head does not share: the engine leaves it in the checkpoint's mapping,
    # resident by the rows read (engine.decode.runtime)
    embedding_by_rows: bool = False

    @property
    def runnable(self) -> bool:
        return self.problem is None

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * CONTEXT_TOKENS

    @property
    def embedding_bytes(self) -> int:
        return self.embedding_params * self.bytes_per_param

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


@dataclass
class _ExpertCount:
    """The offloaded experts of a model built on the meta device, counted as the engine lays them out."""

    layers: int = 0  # MoE layers
    num_experts: int = 0  # per MoE layer
    top_k: int = 0
    params: int = 0  # every routed expert of every layer
    matrix_params: int = 0  # of those, the expert matrices'
    per_expert: int = 0  # one expert's params
    slot: int = 0  # one expert slot, in bytes
    param_shapes: list[tuple[int, ...]] = field(default_factory=list)  # one expert's share of each parameter
    transposed: bool = False
    problem: str | None = None  # why the engine cannot offload them


def estimate_from_config(config: dict, *, weight_file_bytes: int | None = None) -> SizeEstimate:
    """Sizes from a config.json dict; `weight_file_bytes` (the safetensors files' total) when known."""
    from engine.model.dtypes import resolve_dtype

    model, cfg = _meta_model(config)
    dtype = resolve_dtype("auto", config)
    itemsize = dtype.itemsize
    experts = _count_experts(model, itemsize)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    dense = total - experts.params
    quant = quantization_of(config)
    download = weight_file_bytes
    if download is None:
        download = _computed_file_bytes(total, experts.matrix_params, itemsize, quant)
    estimate = SizeEstimate(
        model_type=str(config.get("model_type")),
        architecture=(config.get("architectures") or [type(model).__name__])[0],
        num_layers=int(getattr(cfg.get_text_config(), "num_hidden_layers", 0) or 0),
        num_moe_layers=experts.layers,
        num_experts=experts.num_experts,
        top_k=experts.top_k,
        total_params=total,
        expert_params=experts.params,
        dense_params=dense,
        active_params=dense + experts.top_k * experts.per_expert * experts.layers,
        embedding_params=_embedding_params(model),
        dtype=dtype_name(dtype),
        bytes_per_param=itemsize,
        dense_bytes=(dense + _persistent_buffers(model)) * itemsize,
        expert_bytes=experts.params * itemsize,
        bytes_per_expert=experts.slot,
        all_expert_bytes=experts.slot * experts.num_experts * experts.layers,
        min_budget_bytes=experts.slot * experts.top_k * experts.layers,
        kv_bytes_per_token=kv_cache_bytes_per_token(cfg, itemsize),
        download_bytes=download,
        quantization=quant,
        problem=experts.problem or config_problem(config),
        notes=_notes(quant, dtype_name(dtype), weight_file_bytes, total * itemsize),
        expert_param_shapes=experts.param_shapes,
        experts_transposed=experts.transposed,
        hidden_size=int(getattr(cfg.get_text_config(), "hidden_size", 0) or 0),
        vocab_size=int(getattr(cfg.get_text_config(), "vocab_size", 0) or 0),
        embedding_by_rows=_embedding_by_rows(model),
    )
    return _in_checkpoint_blocks(estimate)


def _count_experts(model, itemsize: int) -> _ExpertCount:
    """The model's offloaded experts: how many, their params and one slot's bytes, the router's top-k."""
    from engine.model.layout import SLOT_ALIGN, offloaded_experts, top_k_of

    named = offloaded_experts(model)
    experts = [m for _, m in named]
    params = sum(p.numel() for m in experts for p in m.parameters(recurse=False))
    matrix_params = sum(p.numel() for m in experts for p in m.parameters(recurse=False) if p.dim() == 3)
    if not experts:
        return _ExpertCount(params=params, matrix_params=matrix_params,
                            problem="a dense model, not a mixture-of-experts model; MoEScope offloads experts")
    first = experts[0]
    num_experts = int(getattr(first, "num_experts", 0) or next(first.parameters(recurse=False)).shape[0])
    count = _ExpertCount(
        layers=len(experts), num_experts=num_experts, params=params, matrix_params=matrix_params,
        slot=_slot_bytes(first, itemsize, SLOT_ALIGN), per_expert=params // (num_experts * len(experts)),
        param_shapes=[tuple(p.shape[1:]) for p in first.parameters(recurse=False)],
        transposed=bool(getattr(first, "is_transposed", False)))
    try:
        count.top_k = top_k_of(model, named[0][0], num_experts)
    except CheckpointError as exc:
        count.problem = str(exc)
    return count


def _notes(quant: str | None, dtype: str, weight_file_bytes: int | None, config_bytes: int) -> list[str]:
    """What the sizes leave unsaid: quantized experts kept so, and weight files that hold more or less
    than the config describes."""
    from engine.accounting.sizes import format_bytes

    notes = []
    if quant:
        notes.append(f"experts stay {quant}; dense weights are counted in {dtype}")
    elif weight_file_bytes is not None and config_bytes and not 0.9 <= weight_file_bytes / config_bytes <= 1.1:
        notes.append(f"the weight files hold {format_bytes(weight_file_bytes)}, the config describes "
                     f"{format_bytes(config_bytes)} (extra layers, e.g. multi-token prediction, or another dtype)")
    return notes


def _embedding_params(model) -> int:
    """The input embedding's parameters; 0 where the model has none to give."""
    try:
        return model.get_input_embeddings().weight.numel()
    except (AttributeError, NotImplementedError):
        return 0


def _embedding_by_rows(model) -> bool:
    """Whether the input embedding is its own tensor (the LM head does not share it)."""
    try:
        embedding = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return False
    head = model.get_output_embeddings()
    return head is None or getattr(head, "weight", None) is not embedding


def _in_checkpoint_blocks(estimate: SizeEstimate) -> SizeEstimate:
    """A runnable quantized checkpoint's experts as the engine keeps them: in the checkpoint's own blocks."""
    quant = estimate.quantization
    kept = QUANTIZED_EXPERTS.get(quant or "")
    if kept is None or not estimate.runnable:
        return estimate
    in_format = estimate.in_format(kept)
    if in_format is None:
        estimate.problem = f"the {quant} expert matrices are not whole {kept.block}-element blocks"
        return estimate
    return replace(in_format, expert_format="original")  # the checkpoint's own format


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


def parallel_for(requested: int, kv_bytes_per_token: int, context_length: int, available_bytes: int) -> int:
    """How many replies decode at once: `requested` if set (at least 1), else as many as
    `available_bytes` holds each one's KV cache for min(context, CONTEXT_TOKENS) tokens, 1 to
    PARALLEL_MAX. The engine asks at load (`--parallel 0`), the fit verdict beside its budget."""
    if requested > 0:
        return requested
    per_reply = kv_bytes_per_token * min(context_length, CONTEXT_TOKENS)
    if per_reply <= 0:
        return PARALLEL_MAX
    return max(1, min(PARALLEL_MAX, available_bytes // per_reply))


def kv_cache_bytes_per_token(cfg, itemsize: int) -> int:
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
