"""The whole-token path (default decode; not with `--exact`): one native call per decode token when every expert is resident.

The native per-layer path (engine.decode.paths.native_layers) runs each layer's weights at close
to the memory bandwidth, but a Qwen3-MoE-shaped token still spent about a third of its time in
Python and small torch ops between those kernels (decoder-layer calls, residual adds, the rotary table, the
mask, module lookups, the router's softmax and top-k as separate ops). For the decoders whose
every piece the native kernels compute (engine.decode.paths.families: Qwen3-MoE, Qwen2-MoE
with its biased q/k/v and gated shared expert, OLMoE with its full-width q/k norms, and Mixtral as transformers writes them, bf16 on
the CPU), `FusedDecoder.step` runs the embedding, every layer
and the lm_head in one call (`DecodeStep` in engine/decode/native/moe_decode.cpp), with the same
kernels in the same order; the expert cache then records the token from the picks it returns,
through the same `record` the per-layer path uses.

It applies only while every expert of every layer is resident and nothing needs a layer's
routing as it happens (a lookahead policy, a trace, a routing restriction); otherwise, and for
the first token of every reply, another path runs.
"""

from __future__ import annotations

from functools import partial

import torch

from engine.accounting.routing import RoutingStep
from engine.decode.kv_cache import BlockLayer
from engine.decode.native import kernels as native
from engine.decode.paths.base import DecodePath, Step
from engine.decode.paths.expert_recipe import experts_recipe
from engine.decode.paths.families import (
    is_linear,
    is_llama_attention,
    is_llama_rms_norm,
    router_recipe,
    whole_token_part,
)
from engine.decode.paths.native_layers import expert_weights, linear_weight, native_problem
from engine.model.dense_formats import QuantizedLinear


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


def recognise(model: torch.nn.Module) -> str:
    """Why the whole-token step cannot run this model ("" when it can), from its modules' classes."""
    inner = getattr(model, "model", None)
    if not whole_token_part(model, "causal_lm") or not whole_token_part(inner, "model"):
        return "the whole-token step runs Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral decoders only"
    embed, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    if type(embed) is not torch.nn.Embedding or not is_linear(head) or head.bias is not None:
        return "the embedding or lm_head is not plain"
    if not (_matrix(embed.weight) and _linear_ok(head)) or not is_llama_rms_norm(inner.norm):
        return "weights are not bf16 on the CPU, or the final norm is not Llama's"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"{rope_type} rotary embeddings change with the length"
    if len(inner.layers) != model.config.num_hidden_layers:
        return "the decoder runs a subset of its layers"
    for index, layer in enumerate(inner.layers):
        problem = _layer_problem(layer)
        if problem:
            return f"layer {index}: {problem}"
    return ""


def _layer_problem(layer: torch.nn.Module) -> str:
    if not whole_token_part(layer, "layer"):
        return "not a Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral decoder layer"
    block = getattr(layer, "mlp", None)
    if not whole_token_part(block, "block"):
        return "a dense MLP or another MoE block"
    if not all(is_llama_rms_norm(norm) for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
        return "its norms are not Llama's RMSNorm"
    attention = layer.self_attn
    if not is_llama_attention(attention, whole_token=True) or not all(
            _linear_ok(getattr(attention, name), bias=name != "o_proj") for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "its attention is not Llama-style in bf16"
    if (problem := _shared_expert_problem(block)):
        return problem
    recipe = router_recipe(block.gate)
    if recipe is None or recipe.softmax_of_top or not _matrix(block.gate.weight):
        return "its router is not a known top-k router"
    recipe = experts_recipe(block.experts)
    if isinstance(recipe, str):
        return recipe
    if not recipe.plain:
        return "its experts have biases, interleaved or transposed matrices (the per-layer kernel computes them)"
    return ""


def _shared_expert_problem(block: torch.nn.Module) -> str:
    """Why the step cannot add this block's shared expert ("" when it can or there is none)."""
    shared, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if shared is None:
        return "" if gate is None else "a shared-expert gate without a shared expert"
    from transformers.activations import SiLUActivation

    projections = [getattr(shared, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(p is not None and _linear_ok(p) for p in projections) or not isinstance(
            getattr(shared, "act_fn", None), SiLUActivation | torch.nn.SiLU):
        return "its shared expert is not a SiLU-gated MLP of bias-free bf16 linears"
    if gate is not None and not (_linear_ok(gate) and gate.out_features == 1):
        return "its shared expert's gate is not one bias-free bf16 row"
    return ""


class FusedDecoder:
    """The native whole-token step of one loaded model, kept in step with the expert cache."""

    def __init__(self, model: torch.nn.Module, cache, kernels) -> None:
        inner = model.model
        gate = inner.layers[0].mlp.gate
        always_normalize, cast_back, _ = router_recipe(gate)
        self.model, self.cache = model, cache
        self.layers = len(inner.layers)
        self.kernels = kernels
        matrix = partial(linear_weight, kernels)
        self._native = kernels.DecodeStep(
            inner.embed_tokens.weight, inner.norm.weight, inner.norm.variance_epsilon, matrix(model.lm_head),
            gate.top_k, bool(always_normalize or getattr(gate, "norm_topk_prob", False)), cast_back)
        for index, layer in enumerate(inner.layers):
            attention, block = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
            eps = next((norm.variance_epsilon for norm in (q_norm, k_norm) if norm is not None), 0.0)
            self._native.add_layer(
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                matrix(attention.q_proj), matrix(attention.k_proj), matrix(attention.v_proj),
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, eps,
                attention.head_dim, attention.scaling, matrix(attention.o_proj),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                block.gate.weight, *self._experts(index))
            if attention.q_proj.bias is not None:
                self._native.set_attention_biases(index, attention.q_proj.bias, attention.k_proj.bias,
                                                  attention.v_proj.bias)
            if (shared := getattr(block, "shared_expert", None)) is not None:
                gate_row = getattr(block, "shared_expert_gate", None)
                self._native.set_shared_expert(index, matrix(shared.gate_proj), matrix(shared.up_proj),
                                               matrix(shared.down_proj),
                                               None if gate_row is None else gate_row.weight.reshape(-1))
        self._placed = (cache.slot_views, cache.directory.changes)
        self._picks = torch.empty((self.layers, gate.top_k), dtype=torch.long)
        # the rotary call reads the embedding row's dtype only
        self._rotary_rows = RotaryRows(inner.rotary_emb, inner.embed_tokens.weight[:1].unsqueeze(0),
                                       inner.layers[0].self_attn.head_dim)

    def _experts(self, layer: int) -> tuple[list, list]:
        """Every expert's (gate_up, down) of `layer`, by expert id, read in place from its slot."""
        slot_of, slots = self.cache.directory.slot_of[layer], self.cache.slot_views[layer]
        return expert_weights(self.kernels, self.cache.reader, [slots[slot_of[e]] for e in range(len(slot_of))])

    def step(self, token: int, past_key_values) -> torch.Tensor:
        """Logits [1, 1, vocab] for `token` at the next position; the KV cache grows by it and the
        expert cache records the token's routing. Call only when `WholeTokenPath` allows it."""
        cache = self.cache
        if self._placed != (cache.slot_views, cache.directory.changes):  # experts moved (a re-plan)
            for layer in range(self.layers):
                self._native.set_experts(layer, *self._experts(layer))
            self._placed = (cache.slot_views, cache.directory.changes)
        position = past_key_values.get_seq_length()
        cos, sin = self._rotary(position)
        buffers = [layer.reserve_next() for layer in past_key_values.layers]
        logits = self._native.run(token, cos, sin, [k for k, _ in buffers], [v for _, v in buffers], position,
                                  self._picks)
        for layer in past_key_values.layers:
            layer.grow_by_one()
        cache.record(RoutingStep.of_token(self._picks.numpy()))
        return logits

    def phase_seconds(self) -> dict[str, float]:
        """Seconds the native steps spent per part so far (norms, qkv_rope, attention, o_proj,
        router, experts, lm_head): the profile of a token that torch's profiler sees as one call."""
        return dict(self._native.phase_seconds())

    def _rotary(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary_rows.at(position)


class WholeTokenPath(DecodePath):
    label = "fast: whole token in one native call"

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self._problem: str | None = None  # why this model has no whole-token step ("" = it has one)
        self._decoder: FusedDecoder | None = None
        self._window: float | None = None  # the narrowest sliding window of the model's attention

    def unavailable(self, step: Step) -> str | None:
        runtime = self.runtime
        problem = native_problem(runtime, step)
        if problem is not None:
            return problem
        if self._problem is None:
            self._problem = recognise(runtime.model)
        if self._problem:
            return self._problem
        if runtime.routing_restricted:
            return "the policy restricts routing to resident experts, layer by layer"
        if problem := runtime.cache.whole_token_problem():
            return problem
        if any(type(layer) is not BlockLayer for layer in step.kv.layers):
            return "the KV cache has layers of another kind"
        window = self._window
        if window is None:
            window = self._window = _narrowest_window(runtime.model)
        if step.position + 1 > window:
            return "the reply reached the attention's sliding window"
        return None

    def run(self, step: Step) -> torch.Tensor:
        return self.decoder.step(step.last_token, step.kv)

    @property
    def decoder(self) -> FusedDecoder:
        """The native step of this model, made on first use (call only when `recognise` accepts it)."""
        if self._decoder is None:
            self._decoder = FusedDecoder(self.runtime.model, self.runtime.cache, native.wait())
        return self._decoder


def _narrowest_window(model: torch.nn.Module) -> float:
    """The narrowest sliding window of the decoder's attention layers (inf when none slides): the
    window each attention module was given, not the config's field (Qwen2-MoE keeps one there with
    `use_sliding_window` off)."""
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]
    return min((w for w in windows if w), default=float("inf"))


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
