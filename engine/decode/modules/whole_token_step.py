"""The whole-token step's Python side: which models it can run (`recognise`, from their modules'
classes, and `slots_problem`, from their expert slots) and `WholeTokenStep`, the native step of one
loaded model (`NativeWholeTokenStep`) set up from its modules and kept in step with the expert cache,
with the rotary rows it is given per token (`RotaryRows`). The path that runs it is
engine.decode.paths.whole_token.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from engine.accounting.routing import RoutingStep
from engine.decode.modules import one_query_attention
from engine.decode.modules.expert_recipe import experts_recipe
from engine.decode.modules.families import (
    is_latent_attention,
    is_linear,
    is_llama_attention,
    is_llama_rms_norm,
    listed,
    norm_rounds_once,
    own_class,
    router_recipe,
    whole_token_part,
)
from engine.decode.modules.native_experts import expert_extras, expert_weights, mixed_layout
from engine.decode.modules.native_modules import linear_weight
from engine.decode.native.library import NativeWholeTokenStep
from engine.model.dense_quantize import QuantizedLinear
from engine.offload.expert_cache import ExpertCache


def _matrix(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def _linear_ok(module: torch.nn.Module, bias: bool = False) -> bool:
    """A linear layer the step reads: a bf16 CPU matrix, or blocks computed in bf16; bias-free
    unless `bias` (then a bf16 one)."""
    if getattr(module, "bias", None) is not None and not (bias and module.bias.dtype == torch.bfloat16):
        return False
    if isinstance(module, QuantizedLinear):
        return module.dtype == torch.bfloat16 and module.packed.device.type == "cpu"
    return isinstance(module, torch.nn.Linear) and _matrix(module.weight)


FAMILIES_NAMED = "Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash"


def _router(block: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE block's router (`gate` in most families, `router` in GPT-OSS)."""
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def _shared(block: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE block's shared expert (`shared_expert` in Qwen2-MoE, `shared_experts` in DeepSeek)."""
    shared = getattr(block, "shared_expert", None)
    return shared if shared is not None else getattr(block, "shared_experts", None)


def _dense(block: torch.nn.Module | None) -> bool:
    """A listed dense MLP in place of an MoE block (DeepSeek's first layers)."""
    return block is not None and own_class(block) in listed("dense_mlps")


def _grouped(router: torch.nn.Module) -> bool:
    """A listed DeepSeek-V3-style grouped sigmoid router with a plain weight and correction bias."""
    weight, bias = getattr(router, "weight", None), getattr(router, "e_score_correction_bias", None)
    return (own_class(router) in listed("grouped_routers") and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and isinstance(bias, torch.Tensor) and bias.numel() == weight.shape[0])


def recognise(model: torch.nn.Module) -> str:
    """Why the whole-token step cannot run this model ("" when it can), from its modules' classes."""
    inner = getattr(model, "model", None)
    if not whole_token_part(model, "causal_lm") or not whole_token_part(inner, "model"):
        return f"the whole-token step runs {FAMILIES_NAMED} decoders only"
    embed, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    if type(embed) is not torch.nn.Embedding or not is_linear(head) or head.bias is not None:
        return "the embedding or lm_head is not plain"
    if not (_matrix(embed.weight) and _linear_ok(head)) or not is_llama_rms_norm(inner.norm, rounding_once=True):
        return "weights are not bf16 on the CPU, or the final norm is not Llama's"
    norms = [inner.norm, *(n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    if len({norm_rounds_once(norm) for norm in norms}) > 1:
        return "its norms round in different ways"
    if not isinstance(getattr(inner.rotary_emb, "inv_freq", None), torch.Tensor):
        return "its rotary embedding has no frequencies to read"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"{rope_type} rotary embeddings change with the length"
    if len(inner.layers) != model.config.num_hidden_layers:
        return "the decoder runs a subset of its layers"
    if all(_dense(layer.mlp) for layer in inner.layers):
        return "no layer has experts"
    for index, layer in enumerate(inner.layers):
        problem = _layer_problem(layer)
        if problem:
            return f"layer {index}: {problem}"
    routers = [_router(layer.mlp) for layer in inner.layers if not _dense(layer.mlp)]
    if len({(type(r), r.top_k, bool(getattr(r, "norm_topk_prob", False))) for r in routers}) > 1:
        return "its routers differ in kind, top k or normalisation"
    return ""


def _layer_problem(layer: torch.nn.Module) -> str:
    if not whole_token_part(layer, "layer"):
        return f"not a {FAMILIES_NAMED} decoder layer"
    block = getattr(layer, "mlp", None)
    if not whole_token_part(block, "block") and not _dense(block):
        return "another kind of MLP or MoE block"
    if not all(is_llama_rms_norm(norm, rounding_once=True) for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
        return "its norms are not Llama's RMSNorm"
    if (problem := _attention_problem(layer.self_attn)):
        return problem
    if _dense(block):
        return _gated_mlp_problem(block, "its dense MLP")
    if (problem := _shared_expert_problem(block)):
        return problem
    router = _router(block)
    if router is None or not (_grouped(router) or _softmax_router(router)):
        return "its router is not a known top-k router"
    recipe = experts_recipe(block.experts)
    if isinstance(recipe, str):
        return recipe
    return ""


def _softmax_router(router: torch.nn.Module) -> bool:
    """A listed top-k router whose recipe the step computes, its weight (and bias, where its recipe
    adds one) in bf16."""
    recipe = router_recipe(router)
    return recipe is not None and _matrix(router.weight) and (not recipe.softmax_of_top or _vector(router.bias))


def _attention_problem(attention: torch.nn.Module) -> str:
    """Why the step cannot compute this attention ("" when it can)."""
    if is_latent_attention(attention):
        return _latent_problem(attention)
    sinks = getattr(attention, "sinks", None)
    if not is_llama_attention(attention, whole_token=True) or not all(
            _linear_ok(getattr(attention, name), bias=True) for name in ("q_proj", "k_proj", "v_proj", "o_proj")) \
            or (sinks is not None and not _vector(sinks)):
        return "its attention is not Llama-style in bf16"
    return ""


def _latent_problem(attention: torch.nn.Module) -> str:
    """Why the step cannot compute this latent attention ("" when it can): bias-free projections in
    bf16 or blocks, Llama-style norms, kv_b_proj a plain bf16 matrix (read per head in place)."""
    lora = attention.q_lora_rank is not None
    names = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj") if lora else ("q_proj", "kv_a_proj_with_mqa", "o_proj")
    norms = (attention.kv_a_layernorm, *((attention.q_a_layernorm,) if lora else ()))
    if not all(_linear_ok(getattr(attention, name, None)) for name in names) \
            or not all(is_llama_rms_norm(norm) for norm in norms):
        return "its latent attention's projections are not bias-free bf16 or block linears"
    up = attention.kv_b_proj.weight
    if not (_matrix(up) and up.is_contiguous()):
        return "its latent attention's kv_b_proj is not a contiguous bf16 matrix"
    return ""


def _vector(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 1


def _shared_expert_problem(block: torch.nn.Module) -> str:
    """Why the step cannot add this block's shared expert ("" when it can or there is none)."""
    shared, gate = _shared(block), getattr(block, "shared_expert_gate", None)
    if shared is None:
        return "" if gate is None else "a shared-expert gate without a shared expert"
    if (problem := _gated_mlp_problem(shared, "its shared expert")):
        return problem
    if gate is not None and not (_linear_ok(gate) and gate.out_features == 1):
        return "its shared expert's gate is not one bias-free bf16 row"
    return ""


def _gated_mlp_problem(mlp: torch.nn.Module, what: str) -> str:
    """Why the step cannot run `mlp` as down(SiLU(gate x) * up x) ("" when it can)."""
    from transformers.activations import SiLUActivation

    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(p is not None and _linear_ok(p) for p in projections) or not isinstance(
            getattr(mlp, "act_fn", None), SiLUActivation | torch.nn.SiLU):
        return f"{what} is not a SiLU-gated MLP of bias-free bf16 linears"
    return ""


class WholeTokenStep:
    """The native whole-token step of one loaded model, kept in step with the expert cache."""

    def __init__(self, model: torch.nn.Module, cache: ExpertCache, kernels) -> None:
        inner = model.model
        # decoder layer of each MoE layer, in the expert cache's order; the others run a dense MLP
        self.moe_layers = [index for index, layer in enumerate(inner.layers) if not _dense(layer.mlp)]
        gate = _router(inner.layers[self.moe_layers[0]].mlp)
        always_normalize, cast_back, softmax_of_top = (False, False, False) if _grouped(gate) else router_recipe(gate)
        self.model, self.cache = model, cache
        self.kernels = kernels
        self.transposed = False
        self._rotary_dim = _rotary_dim(inner.rotary_emb)
        matrix = partial(linear_weight, kernels)
        self._native = kernels.NativeWholeTokenStep(
            inner.embed_tokens.weight, inner.norm.weight, inner.norm.variance_epsilon, matrix(model.lm_head),
            gate.top_k, bool(always_normalize or getattr(gate, "norm_topk_prob", False)), cast_back,
            softmax_of_top, norm_rounds_once(inner.norm))
        cache_layer = {index: layer for layer, index in enumerate(self.moe_layers)}  # its expert cache layer
        self._kv_shapes: list[tuple[int, int, int]] = []  # per layer: a cache layer's heads, key and value widths
        for index, layer in enumerate(inner.layers):
            attention, block = layer.self_attn, layer.mlp
            self._kv_shapes.append(_kv_shape(attention))
            self._native.add_layer(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                                   matrix(attention.o_proj), layer.post_attention_layernorm.weight,
                                   layer.post_attention_layernorm.variance_epsilon)
            if is_latent_attention(attention):
                self._add_latent_attention(index, attention, matrix)
            else:
                self._add_attention(index, attention, matrix)
            if _dense(block):
                self._native.set_shared_expert(index, matrix(block.gate_proj), matrix(block.up_proj),
                                               matrix(block.down_proj), None)
                continue
            router = _router(block)
            if _grouped(router):
                self._native.set_grouped_router(
                    index, router.weight.float().contiguous(), router.e_score_correction_bias.float().contiguous(),
                    router.num_group, router.topk_group, router.routed_scaling_factor)
            else:
                self._native.set_router(index, router.weight)
            if softmax_of_top:
                self._native.set_router_bias(index, router.bias)
            experts = self._experts(cache_layer[index])
            self.transposed = experts[4]  # read as x @ W (GPT-OSS's bf16 experts): one reply per step
            self._native.set_experts(index, *experts)
            if (shared := _shared(block)) is not None:
                gate_row = getattr(block, "shared_expert_gate", None)
                self._native.set_shared_expert(index, matrix(shared.gate_proj), matrix(shared.up_proj),
                                               matrix(shared.down_proj),
                                               None if gate_row is None else gate_row.weight.reshape(-1))
        self._placed = (cache.slot_views, cache.directory.changes)
        # room for the experts of the most tokens a step takes; a step of n fills the first n rows
        self._picks = torch.empty((NativeWholeTokenStep.MAX_ROWS, len(self.moe_layers), gate.top_k), dtype=torch.long)
        # the constant parts of each token's RoutingStep, made once: between tokens every numpy or
        # torch call runs cold (the weight streams evict its code and data), so the per-token
        # bookkeeping keeps to one sort
        self._rows = np.arange(len(self.moe_layers), dtype=np.int64)
        self._ones = np.ones((len(self.moe_layers), gate.top_k), dtype=np.int64)
        # the rotary call reads the embedding row's dtype only
        self._rotary_rows = RotaryRows(inner.rotary_emb, inner.embed_tokens.weight[:1].unsqueeze(0),
                                       self._rotary_dim)

    def _add_attention(self, index: int, attention: torch.nn.Module, matrix) -> None:
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        eps = next((norm.variance_epsilon for norm in (q_norm, k_norm) if norm is not None), 0.0)
        self._native.set_attention(
            index, matrix(attention.q_proj), matrix(attention.k_proj), matrix(attention.v_proj),
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, eps,
            attention.head_dim, attention.scaling, self._rotary_dim)
        if attention.q_proj.bias is not None:
            self._native.set_attention_biases(index, attention.q_proj.bias, attention.k_proj.bias,
                                              attention.v_proj.bias)
        sinks = getattr(attention, "sinks", None)
        eager = one_query_attention.is_eager(attention.config)
        if sinks is not None or eager or attention.o_proj.bias is not None:
            self._native.set_attention_extras(index, sinks, eager, attention.o_proj.bias)

    def _add_latent_attention(self, index: int, attention: torch.nn.Module, matrix) -> None:
        lora = attention.q_lora_rank is not None
        kv_norm = attention.kv_a_layernorm
        self._native.set_latent_attention(
            index, matrix(attention.q_a_proj) if lora else None, attention.q_a_layernorm.weight if lora else None,
            attention.q_a_layernorm.variance_epsilon if lora else 0.0,
            matrix(attention.q_b_proj if lora else attention.q_proj), matrix(attention.kv_a_proj_with_mqa),
            kv_norm.weight, kv_norm.variance_epsilon, attention.kv_b_proj.weight, attention.num_heads,
            attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim, attention.scaling,
            bool(getattr(attention.config, "rope_interleave", False)))

    def _experts(self, layer: int) -> tuple:
        """`set_experts`' arguments for MoE layer `layer`: every expert's gate_up and down by expert
        id, read in place from its slot, their biases, their layout and their gate."""
        slot_of, slots = self.cache.directory.slot_of[layer], self.cache.slot_views[layer]
        chosen = [slots[slot_of[e]] for e in range(len(slot_of))]
        recipe = experts_recipe(self.model.model.layers[self.moe_layers[layer]].mlp.experts)
        reader = self.cache.reader_at(layer)
        return *expert_weights(self.kernels, reader, chosen), *expert_extras(self.kernels, reader, chosen, recipe)

    def step(self, token: int, past_key_values) -> torch.Tensor:
        """Logits [1, 1, vocab] for `token` at the next position; the KV cache grows by it and the
        expert cache records the token's routing. Call only when `WholeTokenPath` allows it."""
        return self.step_parts([([token], past_key_values)])[0]

    def step_prompt(self, tokens: list[int], kv) -> torch.Tensor:
        """A short prompt (into an empty KV cache) as the rows of one step: the logits of its last
        position [1, 1, vocab] (see `step_parts`)."""
        return self.step_parts([(tokens, kv)])[0]

    def step_rows(self, tokens: list[int], caches: list) -> tuple[torch.Tensor, np.ndarray]:
        """One step for several replies (each its `token` and its KV cache): their logits [rows, 1,
        vocab] and their experts [rows, MoE layers, top_k] in order of id (see `step_parts`)."""
        logits, picks = self.step_parts([([token], kv) for token, kv in zip(tokens, caches, strict=True)])
        return logits, np.concatenate(picks)

    def step_parts(self, parts: list[tuple[list[int], object]]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Several replies' tokens in one step, every weight read once for all of them: each part is
        a reply's next token (its KV cache and one token), or a short prompt (into an empty cache, at
        most `MAX_ROWS` rows in all). A prompt's tokens are rows at positions 0..n-1 of its cache, each
        attending to itself and the rows before it, as a prompt's causal attention does. Each row's
        sums are the ones it gets alone: a reply's logits, experts and KV entries are bit for bit its
        own, and a prompt gets the bits of its tokens fed one by one.

        Returns the logits of each part's last position [parts, 1, vocab] and each part's experts
        [tokens, MoE layers, top_k] in order of id. The caches grow by the parts' tokens and
        the expert cache records each part: a token as a decode step, a prompt as one prompt step.
        Call only when `WholeTokenPath` allows it."""
        self._place_experts()
        lead, last = [], []  # rows without logits (prompts' earlier positions) first, then each part's last
        for index, (tokens, kv) in enumerate(parts):
            if not kv.get_seq_length():  # a prompt: its cache's first positions
                for layer, (heads, key_width, value_width) in zip(kv.layers, self._kv_shapes, strict=True):
                    layer.open_empty(torch.empty((1, heads, 0, key_width), dtype=torch.bfloat16),
                                     torch.empty((1, heads, 0, value_width), dtype=torch.bfloat16))
            n, position = len(tokens), kv.get_seq_length()
            keys, values, starts, lengths = zip(*(layer.reserve_next(n) for layer in kv.layers), strict=True)
            for r, token in enumerate(tokens):
                row = (index, token, position + r, keys, values, starts, [length + r for length in lengths])
                (last if r == n - 1 else lead).append(row)
        rows = lead + last
        index, tokens, positions, keys, values, starts, lengths = zip(*rows, strict=True)
        cos, sin = self._rotary(positions)
        picks = self._picks[:len(rows)]
        logits = self._native.run(list(tokens), cos, sin, keys, values, starts, lengths, picks, logit_rows=len(parts))
        for part_tokens, kv in parts:
            for layer in kv.layers:
                layer.grow_by(len(part_tokens))
        ordered = picks.numpy().copy()  # in order of id (the step sorts them); the buffer is the next step's
        rows_of: list[list[int]] = [[] for _ in parts]  # each part's rows in order of position
        for r, part in enumerate(index):
            rows_of[part].append(r)
        of_part = [ordered[own] for own in rows_of]
        for experts in of_part:
            self._record(experts)
        return logits, of_part

    def _record(self, experts: np.ndarray) -> None:
        """Count a part's routing [tokens, MoE layers, top_k]: one token as a decode step, a prompt's
        tokens as one prompt step (its last position's experts the ones a trace keeps)."""
        cache, n = self.cache, experts.shape[0]
        if n == 1:
            cache.record_resident(RoutingStep(self._rows, experts[0], self._ones))
            return
        for row, layer in enumerate(self._rows):
            distinct, counts = np.unique(experts[:, row], return_counts=True)
            cache.record_resident(RoutingStep.of_layer(int(layer), distinct, counts, n, experts[-1, row]))

    def _place_experts(self) -> None:
        """Point the step at the experts' slots again where they moved (a re-plan)."""
        cache = self.cache
        if self._placed != (cache.slot_views, cache.directory.changes):
            for layer, index in enumerate(self.moe_layers):
                self._native.set_experts(index, *self._experts(layer))
            self._placed = (cache.slot_views, cache.directory.changes)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds the native steps spent per part so far (norms, qkv_rope, attention, o_proj,
        router, experts, lm_head): the profile of a token that torch's profiler sees as one call."""
        return dict(self._native.phase_seconds())

    def _rotary(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rows (cos, sin) of each of `positions`, one row per position."""
        rows = [self._rotary_rows.at(position) for position in positions]
        return torch.stack([c.reshape(-1) for c, _ in rows]), torch.stack([s.reshape(-1) for _, s in rows])


def _kv_shape(attention: torch.nn.Module) -> tuple[int, int, int]:
    """What a cache layer holds per position for this attention in the step: (heads, key width, value
    width); MLA's one latent row and one shared rotary key."""
    if is_latent_attention(attention):
        return 1, attention.kv_lora_rank, attention.qk_rope_head_dim
    return attention.k_proj.out_features // attention.head_dim, attention.head_dim, attention.head_dim


def _rotary_dim(rotary: torch.nn.Module) -> int:
    """How many values of a head the rotary embedding turns: a head, part of one (GLM-4-MoE's partial
    rotary), MLA's rotary part; two per frequency of the model's rotary module."""
    return 2 * rotary.inv_freq.numel()


def slots_problem(model: torch.nn.Module, reader) -> str:
    """Why the step cannot read this model's expert slots ("" when it can)."""
    first = next(layer.mlp for layer in model.model.layers if not _dense(layer.mlp))
    if mixed_layout(experts_recipe(first.experts), reader):
        return "one of the experts' matrices is quantized and the other transposed"
    return ""


class RotaryRows:
    """The model's own rotary rows (cos, sin) for one position at a time, computed a block of
    positions per call where that gives the same bits as one call per position.

    One call of the rotary module per token was a visible part of the step (most of it the module
    call's fixed cost). Its arithmetic is elementwise (position x frequency, then cos and sin), so
    a row comes out the same in a call over many positions, as long as torch runs every element
    through its vectorized loop: the last `len % 32` elements of a call go through the scalar
    `std::cos`, which may round differently, and a split across threads could cut elsewhere. So
    blocks are used only when the head size is a multiple of 32, a block stays under torch's
    one-thread size, and a few rows of the first block match single calls; else one call each.
    """

    BLOCK_ELEMENTS = 16384  # under at::internal::GRAIN_SIZE (32768): one thread, one vectorized loop

    def __init__(self, rotary: torch.nn.Module, like: torch.Tensor, head_dim: int) -> None:
        self.rotary, self.like = rotary, like
        self.rows = self.BLOCK_ELEMENTS // head_dim if head_dim % 32 == 0 else 0
        self._block, self._cached = -1, ([], [])
        if self.rows and any(_bits(self.at(p)) != _bits(self._single(p)) for p in (0, 1, 3, self.rows - 1)):
            self.rows = 0

    def at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.rows:
            return self._single(position)
        block, row = divmod(position, self.rows)
        if block != self._block:
            start = block * self.rows
            cos, sin = self.rotary(self.like, position_ids=torch.arange(start, start + self.rows).unsqueeze(0))
            self._block, self._cached = block, (cos[0].unbind(0), sin[0].unbind(0))
        return self._cached[0][row], self._cached[1][row]

    def _single(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(self.like, position_ids=torch.tensor([[position]]))
        return cos.reshape(-1), sin.reshape(-1)


def _bits(rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[bytes, ...]:
    return tuple(t.view(torch.int16).numpy().tobytes() for t in rows)
