"""The model's modules on the native kernels: the classes a native decode path switches a loaded
model's plain linears (bf16 or quantized), listed RMSNorms, Llama-style and latent attention and
top-k routers onto (`install`, `patch_module`), and `linear_weight`, a linear's weight as the kernels
take it. Each patched module reads its model's switch (engine.decode.modules.switch) and computes as
transformers does whenever that is off; the paths that turn it on are in engine.decode.paths.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from engine.decode.modules import one_query_attention
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
from engine.model.cache_argument import cache_from_call
from engine.model.dense_quantize import QuantizedLinear


def _native_kernels(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                    prompt_rows: bool = False) -> Kernels | None:
    """The kernels, if `module`'s model is in a native step (or, with `prompt_rows`, a fast prompt)
    and they apply: bf16 input and weight, CPU."""
    switch = module.__dict__.get(SWITCH_ATTR)
    inside = switch is not None and (switch.on or (prompt_rows and switch.rows))
    if not inside or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
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
    # a prompt's rows too: one call instead of eight small ops on each norm's rows, the same sums per row
    kernels = _native_kernels(self, hidden_states, self.weight, prompt_rows=True)
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


def install(model: torch.nn.Module) -> NativeSwitch:
    """Give `model`'s qualifying modules their native-step classes, all reading one new switch, and
    route its SDPA or eager attention through the one-query versions (same results outside a native step)."""
    switch = NativeSwitch()
    for module in model.modules():
        patch_module(module, switch)
    one_query_attention.install(model)
    return switch
