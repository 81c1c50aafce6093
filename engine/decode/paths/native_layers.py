"""The native per-layer path (the default decode; `--exact` turns it off): a decode token through the model's own forward,
with the modules the native kernels compute switched onto them. The same arithmetic as
transformers, summed in a different order: faster, not bit-identical.

For one new token (a prompt keeps transformers' kernels but for its quantized experts, plain
linears and routers: `NativePromptPath`), while the path runs:
- a layer's resident experts run in one native call (gate/up, gate, down, biases, weighted sum)
  when their recipe is one the kernel computes (engine.decode.modules.expert_recipe: every family
  whose experts are gated MLPs): the expert cache is handed that kernel (`ExpertCache.experts_kernel`);
- plain bf16 `nn.Linear`s of one row (biased or not) use the native GEMV, Llama-style RMSNorms one call instead
  of eight small ops, Llama-style attention three (q/k/v with q/k norms and rotary, attention over
  the KV cache, o_proj) instead of ~60, DeepSeek-V3-style latent attention over the cached latents
  with its up-projection absorbed (engine.decode.modules.latent_attention), and listed top-k routers
  the GEMV for their linear;
- other attention of one query (SDPA or eager, with attention sinks and additive masks) runs as two
  float32 matmuls and a softmax (engine.decode.modules.one_query_attention).
Which modules qualify is decided by their class (engine.decode.modules.families). Each patched
module reads a switch that belongs to its model and is on only inside this path's `run`, so
outside it every module computes exactly as transformers does; no process-wide torch setting
is touched.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import torch
import torch.nn.functional as F

from engine.decode.modules import one_query_attention
from engine.decode.modules.expert_recipe import ExpertsRecipe, experts_recipe
from engine.decode.modules.families import (
    is_latent_attention,
    is_llama_attention,
    is_llama_rms_norm,
    norm_rounds_once,
    router_recipe,
)
from engine.decode.modules.latent_attention import latent_attention_forward
from engine.decode.modules.switch import SWITCH_ATTR, NativeSwitch
from engine.decode.native import kernels as native
from engine.decode.native.library import Kernels
from engine.decode.paths.base import DecodePath, Step
from engine.decode.paths.context import DecodeContext
from engine.decode.paths.transformers_path import model_forward
from engine.formats.blocks import BlockFormat
from engine.model.cache_argument import cache_from_call
from engine.model.dense_quantize import QuantizedLinear
from engine.offload.expert_compute import PromptKernels, QuantizedProduct, SlotReader, torch_one_token


def _native_kernels(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> Kernels | None:
    """The kernels, if `module`'s model is in a native step and they apply: bf16 input and weight, CPU."""
    switch = module.__dict__.get(SWITCH_ATTR)
    if switch is None or not switch.on or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 \
            or x.device.type != "cpu":
        return None
    return native.ready()


def _one_row_kernels(module: torch.nn.Module, x: torch.Tensor) -> Kernels | None:
    """The kernels for one bf16 CPU row through a linear (the GEMV): inside a native step, and in a
    fast prompt, whose last position alone goes through the LM head (there a quantized head was
    expanded whole to bf16 for torch's product: a few percent of a 128-token prompt)."""
    switch = module.__dict__.get(SWITCH_ATTR)
    if switch is None or not (switch.on or switch.rows) or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return native.ready()


def _row_kernels(module: torch.nn.Module, x: torch.Tensor, quantized: bool) -> Kernels | None:
    """The kernels, if `module`'s model is in a fast prompt and `linear_rows` takes these rows: bf16 on
    the CPU, whole 32-column groups, and for a bf16 weight where the native rows beat torch's bf16
    matmul (`native.rows_beat_torch_bf16`; a quantized weight always gains, being multiplied in its
    blocks instead of expanded)."""
    switch = module.__dict__.get(SWITCH_ATTR)
    if switch is None or not switch.rows or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] % 32:
        return None
    kernels = native.ready()
    return kernels if kernels is not None and (quantized or native.rows_beat_torch_bf16(kernels)) else None


def _rows(kernels: Kernels, module: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
          int8_inputs: bool = False) -> torch.Tensor:
    """x's rows (any leading shape) through `module`'s weight on `linear_rows`, as F.linear."""
    rows = x.reshape(-1, x.shape[-1])
    return kernels.linear_rows(linear_weight(kernels, module), rows, bias, int8_inputs).view(*x.shape[:-1], -1)


class FastLinear(torch.nn.Linear):
    """`nn.Linear` whose bf16 products use the native kernels: one row inside a native step (GEMV),
    many rows inside a fast prompt."""

    _moescope_plain = torch.nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            kernels = _one_row_kernels(self, x) if self.weight.dtype == torch.bfloat16 else None
            if kernels is not None and _bf16_bias(self.bias):
                return kernels.gemv(linear_weight(kernels, self), x, self.bias)
        elif self.weight.dtype == torch.bfloat16 and _bf16_bias(self.bias) \
                and (kernels := _row_kernels(self, x, quantized=False)) is not None:
            return _rows(kernels, self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


class FastQuantizedLinear(QuantizedLinear):
    """A `QuantizedLinear` whose products read its blocks natively: one row inside a native step,
    many rows inside a fast prompt."""

    _moescope_plain = QuantizedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features:
            kernels = _row_kernels(self, x, quantized=True) if _bf16_bias(self.bias) else None
            if kernels is None:
                return super().forward(x)
            int8 = self.__dict__[SWITCH_ATTR].int8_rows  # the opt-in 8-bit prompt inputs reach Q4_K linears too
            return _rows(kernels, self, x, self.bias, int8)
        kernels = _one_row_kernels(self, x)
        if kernels is None or not _bf16_bias(self.bias):
            return super().forward(x)
        return kernels.gemv(linear_weight(kernels, self), x, self.bias)


def _bf16_bias(bias: torch.Tensor | None) -> bool:
    """No bias, or one the GEMV adds before its rounding (as F.linear does): bf16, contiguous."""
    return bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())


def linear_weight(kernels: Kernels, module: torch.nn.Module):
    """A linear layer's weight as the kernels take it (bf16, or its blocks), made once per module."""
    source = module.packed if isinstance(module, QuantizedLinear) else module.weight
    cached = module.__dict__.get("_moescope_weight")
    if cached is None or cached[0] is not source:
        made = (native.weight(kernels, source, module.fmt, module.in_features) if isinstance(module, QuantizedLinear)
                else native.weight(kernels, source))
        cached = module.__dict__["_moescope_weight"] = (source, made)
    return cached[1]


def _fast_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    kernels = _native_kernels(self, hidden_states, self.weight)
    if kernels is None:
        return self._plain_forward(hidden_states)
    return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon, norm_rounds_once(self))


def _fast_attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                            attention_mask: torch.Tensor | None, *args, **kwargs):
    """One token of Llama-style attention in three native calls (q/k/v with biases, norms and rotary,
    the attention over the cache with GPT-OSS's sinks, o_proj); anything else takes the module's own
    forward. A mask must allow every cached position: a sliding window's cache layer keeps only the
    window's positions, and any other mask (padding, a window over a full cache) is the own forward's."""
    kernels = _native_kernels(self, hidden_states, hidden_states)  # projections in bf16 or blocks alike
    cos, sin = position_embeddings
    kv = cache_from_call(args, kwargs)
    sinks = getattr(self, "sinks", None)
    # rotary rows of a head, or of half of one (GPT-OSS's, which the kernel doubles)
    if (kernels is None or kv is None or hidden_states.numel() != hidden_states.shape[-1]
            or cos.numel() not in (self.head_dim, self.head_dim // 2) or cos.dtype != torch.bfloat16
            or not _allows_all(attention_mask)
            or (sinks is not None and sinks.dtype != torch.bfloat16)):
        return self._plain_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    eps = next((norm.variance_epsilon for norm in (q_norm, k_norm) if norm is not None), 0.0)  # one for both
    projections = (self.q_proj, self.k_proj, self.v_proj)
    q, k, v = (linear_weight(kernels, proj) for proj in projections)
    biases = [proj.bias for proj in projections] if self.q_proj.bias is not None else []
    query, key, value = kernels.qkv_rope(
        hidden_states, q, k, v,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, eps, cos, sin,
        self.head_dim, biases)
    key, value = kv.update(key, value, self.layer_idx)
    out = kernels.attend(query, key, value, self.scaling, sinks, one_query_attention.is_eager(self.config))
    return self.o_proj(out.view(*hidden_states.shape[:-1], -1)), None


def _allows_all(mask: torch.Tensor | None) -> bool:
    """No mask, or one query's mask that allows every position (boolean True, additive 0)."""
    if mask is None:
        return True
    if mask.shape[-2] != 1 or mask.shape[0] != 1:
        return False
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


def _fast_router_forward(self, hidden_states: torch.Tensor):
    """A top-k router whose linear is the native GEMV for one token (torch's bf16 kernel without
    oneDNN took most of a layer's routing time) and `linear_rows` for a fast prompt's rows; softmax
    and top-k stay torch's."""
    recipe = self._moescope_recipe
    bias = self.bias if recipe.softmax_of_top else None
    rows = hidden_states.reshape(-1, self.weight.shape[1])
    if rows.shape[0] == 1:
        kernels = _native_kernels(self, hidden_states, self.weight)
        product = kernels.gemv if kernels is not None else None
    else:
        kernels = _row_kernels(self, hidden_states, quantized=False) if self.weight.dtype == torch.bfloat16 else None
        product = kernels.linear_rows if kernels is not None else None
    if product is None or not _bf16_bias(bias):
        return self._plain_forward(hidden_states)
    always_normalize, cast_back, softmax_of_top = recipe
    logits = product(linear_weight(kernels, self), rows, bias)
    if softmax_of_top:
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top_value, dim=1, dtype=top_value.dtype), top_index
    top_value, top_index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
    if always_normalize or getattr(self, "norm_topk_prob", False):
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return logits, top_value.to(logits.dtype) if cast_back else top_value, top_index


@cache
def _fast_class(cls: type, forward) -> type:
    """A subclass of `cls` whose forward is `forward`, the original kept as `_plain_forward`: one per
    class, shared by every model of the session."""
    return type(f"Fast{cls.__name__}", (cls,), {"forward": forward, "_plain_forward": cls.forward, "_moescope_plain": cls})


def _patched(cls: type) -> bool:
    """`cls` is a native-step class already: FastLinear, FastQuantizedLinear or one `_fast_class` made."""
    return "_moescope_plain" in vars(cls)


def patch_module(module: torch.nn.Module, switch: NativeSwitch) -> bool:
    """Give `module` its native-step class if it has one (a plain linear, a listed RMSNorm, attention
    or router); True if it has it now. Same parameters, same results outside a native step."""
    module.__dict__[SWITCH_ATTR] = switch
    cls = type(module)
    if _patched(cls):
        return True  # patched before (a live switch back on)
    if cls is torch.nn.Linear:
        module.__class__ = FastLinear
    elif cls is QuantizedLinear:
        module.__class__ = FastQuantizedLinear
    elif is_llama_rms_norm(module, rounding_once=True):
        module.__class__ = _fast_class(cls, _fast_rms_norm_forward)
    elif is_llama_attention(module):
        module.__class__ = _fast_class(cls, _fast_attention_forward)
    elif is_latent_attention(module):
        module.__class__ = _fast_class(cls, latent_attention_forward)
    elif (recipe := router_recipe(module)) is not None:
        module.__class__ = _fast_class(cls, _fast_router_forward)
        module._moescope_recipe = recipe
    else:
        return False
    return True


class NativeExperts:
    """The one-token experts kernel of a native step: a layer's resident picks in one native call,
    for every experts module whose recipe the kernel computes (engine.decode.modules.expert_recipe:
    gated, with or without biases, halves or interleaved, [out, in] or transposed)."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def __call__(self, module: torch.nn.Module, hidden: torch.Tensor, chosen: list[dict[str, torch.Tensor]],
                 weights: torch.Tensor, out_dtype: torch.dtype, reader: SlotReader) -> torch.Tensor:
        recipe = kernel_recipe(module, reader, hidden)
        if recipe is None:
            return torch_one_token(module, hidden, chosen, weights, out_dtype, reader)
        gate_up, down = expert_weights(self.kernels, reader, chosen)
        if recipe.plain:
            return self.kernels.moe_decode(hidden, gate_up, down, weights)
        return self.kernels.moe_decode(hidden, gate_up, down, weights, *expert_extras(self.kernels, reader, chosen, recipe))


class NativePromptExperts:
    """A prompt's resident experts of one layer in one native call (`moe_prompt`), for the modules
    the one-token kernel also computes (engine.decode.modules.expert_recipe), laid out [out, in]."""

    def __init__(self, kernels: Kernels, int8_inputs: bool = False) -> None:
        self.kernels = kernels
        self.int8_inputs = int8_inputs  # opt-in, lossy: Q4_K matrices take their inputs rounded to 8 bits

    def __call__(self, module: torch.nn.Module, rows: torch.Tensor, start: list[int], count: list[int],
                 chosen: list[dict[str, torch.Tensor]], reader: SlotReader) -> torch.Tensor | None:
        recipe = kernel_recipe(module, reader, rows)
        if recipe is None:
            return None
        *biases, transposed, gate = expert_extras(self.kernels, reader, chosen, recipe)
        if transposed:  # bf16 matrices read as x @ W: the prompt kernel tiles [out, in] rows
            return None
        gate_up, down = expert_weights(self.kernels, reader, chosen)
        return self.kernels.moe_prompt(rows, start, count, gate_up, down, *biases, gate, self.int8_inputs)


def kernel_recipe(module: torch.nn.Module, reader: SlotReader, x: torch.Tensor) -> ExpertsRecipe | None:
    """The recipe the native experts kernels compute for `module` on these slots and input; None
    where they do not (an unrecognised recipe, a mixed layout, oneDNN-packed matrices, a non-bf16 input)."""
    recipe = experts_recipe(module)
    if isinstance(recipe, str) or mixed_layout(recipe, reader) or reader.packed or x.dtype != torch.bfloat16:
        return None
    return recipe


def mixed_layout(recipe: ExpertsRecipe, reader: SlotReader) -> bool:
    """One of a transposed module's matrices is quantized and the other not: quantized slots hold
    [out, in] blocks whatever the module's layout (engine.model.layout), so the two would need two
    layouts in one call."""
    return recipe.transposed and 0 < len(reader.quantized) < 2


def expert_extras(kernels: Kernels, reader: SlotReader, chosen: list[dict[str, torch.Tensor]],
                  recipe: ExpertsRecipe) -> tuple[list, list, bool, object]:
    """What the kernels take beside the matrices of the experts in `chosen`: their gate_up and down
    biases (or none), whether the matrices are read as x @ W, and their gate."""
    biases = ([w["gate_up_proj_bias"] for w in chosen], [w["down_proj_bias"] for w in chosen]) if recipe.bias \
        else ([], [])
    # quantized slots hold [out, in] blocks whatever the module's layout (engine.model.layout)
    return *biases, recipe.transposed and not reader.quantized, _gate(kernels, recipe)


@cache
def _gate(kernels: Kernels, recipe: ExpertsRecipe):
    return kernels.GateRecipe(recipe.interleaved, recipe.clamped_swiglu, recipe.alpha, recipe.limit)


def expert_weights(kernels: Kernels, reader: SlotReader, chosen: list[dict[str, torch.Tensor]]) -> tuple[list, list]:
    """The (gate_up, down) matrices of each expert in `chosen` (views of their slots), as the
    kernels take them: bf16, or blocks of the experts' format."""
    out = []
    for name in ("gate_up_proj", "down_proj"):
        param = reader.quantized.get(name)
        if param is None:
            out.append([native.weight(kernels, w[name]) for w in chosen])
        else:
            columns = param.rows_columns[1]
            out.append([native.weight(kernels, w[name], param.fmt, columns) for w in chosen])
    return out[0], out[1]


def install(model: torch.nn.Module) -> NativeSwitch:
    """Give `model`'s qualifying modules their native-step classes, all reading one new switch, and
    route its SDPA or eager attention through the one-query versions (same results outside a native step)."""
    switch = NativeSwitch()
    for module in model.modules():
        patch_module(module, switch)
    one_query_attention.install(model)
    return switch


def kernels_problem(context: DecodeContext) -> str | None:
    """Why the native kernels cannot run for this model now (every native path asks); None when they can."""
    if not context.settings.fast_decode:
        return "exact kernels were asked for (--exact, or the System panel's Exact switch)"
    if context.device.type != "cpu":
        return "the native kernels run on the CPU"
    if context.dtype != torch.bfloat16:
        return f"the native kernels compute bf16 weights; this model runs in {str(context.dtype).removeprefix('torch.')}"
    if native.ready() is None:
        return native.status()
    return None


def native_problem(context: DecodeContext, step: Step) -> str | None:
    """Why no native kernel can run `step` (shared by both native decode paths); None when they can."""
    if step.prefill and context.settings.fast_decode:
        return "prompts (prefill) run on transformers' kernels"
    if problem := kernels_problem(context):
        return problem
    if context.cache.packed_params:
        return "the expert matrices are packed for oneDNN (they are unpacked when the Exact switch is turned off)"
    return None


def quantized_product(kernels: Kernels) -> QuantizedProduct:
    """Rows times a quantized slot's matrix on the native kernels: each tile of the matrix is expanded
    once in L1 and multiplied by all rows (`linear_rows`), never the whole expert into a scratch."""

    def product(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, columns: int) -> torch.Tensor:
        return kernels.linear_rows(native.weight(kernels, blocks, fmt, columns), x)

    return product


class NativePromptPath(DecodePath):
    """A prompt's forward on transformers' kernels, with quantized experts multiplied in their blocks
    by the native kernels (the exact path expands each into a scratch for oneDNN, which re-packs it),
    and the plain linears and routers on `linear_rows`: oneDNN makes and keeps a kernel for every
    new row count, which grew the process by about half a MiB per linear shape and prompt length.
    bf16 experts take the native call too where it beats torch's bf16 matmul (CPUs where that has
    no oneDNN kernel)."""

    def __init__(self, context: DecodeContext, native_layers: NativeLayersPath) -> None:
        self.context = context
        self.native_layers = native_layers  # its switch, once installed, takes the prompt's linears onto the kernels

    @property
    def label(self) -> str:
        tiles = self._tiles()
        asked = self.context.settings.int8_prompt
        if asked and not tiles:
            return "fast: prompt's experts and linears on the native kernels, 8-bit inputs to 4-bit matrices (lossy)"
        unused = "; 8-bit inputs not used: the tiles are faster" if asked else ""
        return f"fast: prompt's experts and linears on the native kernels{' (AMX tiles)' if tiles else ''}{unused}"

    @staticmethod
    def _tiles() -> bool:
        kernels = native.ready()
        return kernels is not None and kernels.amx()

    def _int8(self) -> bool:
        """The lossy 8-bit prompt inputs, where asked for and they pay: not beside AMX tiles, whose bf16
        products are the faster there (docs/performance-history.md, "AMX tiles for prompts"), so the
        request is set aside there and the path's label says so."""
        return self.context.settings.int8_prompt and not self._tiles()

    def unavailable(self, step: Step) -> str | None:
        if not step.prefill:
            return "one-token steps take the decode paths"
        if problem := kernels_problem(self.context):
            return problem
        if not self.context.cache.quantized_slots and not native.bf16_prompt_beats_torch(native.ready()):
            return "the experts are bf16 and oneDNN's bf16 matmuls are the faster here: transformers' kernels run the prompt"
        return None

    def run(self, step: Step) -> torch.Tensor:
        kernels = native.ready()
        switch = self.native_layers.switch  # installed when fast decode was turned on
        int8 = self._int8()
        with self.context.cache.prompt_kernels(PromptKernels(NativePromptExperts(kernels, int8),
                                                             quantized_product(kernels), kernels.combine_rows)), \
                switch.prompt_rows(int8=int8) if switch is not None else nullcontext():
            return model_forward(self.context.model, step)


class NativeLayersPath(DecodePath):
    """The model's forward with its qualifying modules and the experts on the native kernels."""

    label = "fast: native kernels, layer by layer"

    def __init__(self, context: DecodeContext) -> None:
        self.context = context
        self._switch: NativeSwitch | None = None

    @property
    def switch(self) -> NativeSwitch | None:
        return self._switch

    def enable(self) -> None:
        """Fast decode was asked for: patch the model's modules (once) and load the kernels."""
        if self._switch is None:
            self._switch = install(self.context.model)
        native.load()

    def unavailable(self, step: Step) -> str | None:
        problem = native_problem(self.context, step)
        if problem is None and self._switch is None:
            return "the native kernels were not set up for this model"
        return problem

    def run(self, step: Step) -> torch.Tensor:
        with self._switch.active(), self.context.cache.experts_kernel(NativeExperts(native.ready())):
            return model_forward(self.context.model, step)
