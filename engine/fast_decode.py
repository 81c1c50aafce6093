"""Opt-in CPU decode kernels (`--fast-decode`): the same arithmetic as transformers, summed in a
different order, so faster but not bit-identical to its default kernels.

Three changes, all for decode steps only (one new token; prefill keeps transformers' kernels):
- where the native kernels are built (engine.decode_kernels), a layer's experts run in one call
  (gate/up, SiLU gate, down, weighted sum) and bf16 `nn.Linear`s of one row use its GEMV: both
  stream weights at close to a plain read's bandwidth. Llama-style RMSNorms run as one call
  instead of eight small ops, and Llama-style attention (Llama, Mixtral, Qwen3-MoE) as three
  (q/k/v with q/k norms and rotary, attention over the KV cache, o_proj) instead of ~60: at one
  token those small ops, not the weights, were most of the attention's time.
- other matrix-vector products in bf16/fp16 skip oneDNN for torch's native kernel. oneDNN streams
  expert-sized weights at about half the memory bandwidth; torch's own kernel at about 85 % of it
  (bench/profile_decode.py: 23 vs 37 GB/s on 2 cores). For many rows oneDNN's GEMM is 15x faster,
  which is why prefill keeps it.
- single-query attention runs as two float32 matmuls and a softmax instead of SDPA's flash
  kernel, which costs ~120 us per layer on 2 cores for one query (the matmuls ~30 us); float32
  accumulation, as the flash kernel does, with the softmax in float32.
float32 models keep their kernels (MKL either way; the attention swap applies to bf16/fp16 only),
so their outputs stay identical to transformers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from engine import decode_kernels

ATTENTION_NAME = "moescope_sdpa"
_active = False  # inside a fast decode step (one generation at a time per engine process)


@contextmanager
def fast_decode_step(enabled: bool) -> Iterator[None]:
    """Within the block, CPU matmuls skip oneDNN and one-query attention takes the matmul path."""
    global _active
    if not enabled:
        yield
        return
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    _active = True
    try:
        yield
    finally:
        _active = False
        torch.backends.mkldnn.enabled = previous


def active() -> bool:
    """Inside a fast decode step."""
    return _active


def _native_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The native kernels, if this is a fast step and they apply: built, bf16 input and weight, CPU."""
    if not _active or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return decode_kernels.ready()


class FastLinear(torch.nn.Linear):
    """`nn.Linear` whose one-row bf16 products use the native GEMV inside a fast decode step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _native_kernels(x, self.weight)
        if kernels is None or x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        y = kernels.gemv(self.weight, x)
        return y if self.bias is None else y + self.bias


def _llama_rms_norm_code():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward.__code__


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """The module's forward is Llama's RMSNorm, as most MoE families copy it (Qwen-MoE, Mixtral...);
    Gemma-style (1 + weight) norms and others keep their own code."""
    code, reference = plain_forward(module).__code__, _llama_rms_norm_code()
    return (isinstance(getattr(module, "weight", None), torch.nn.Parameter) and hasattr(module, "variance_epsilon")
            and (code.co_code, code.co_consts, code.co_names) == (reference.co_code, reference.co_consts, reference.co_names))


def _fast_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    kernels = _native_kernels(hidden_states, self.weight)
    if kernels is None:
        return self._plain_forward(hidden_states)
    return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _llama_attention_codes() -> set:
    """The attention forwards whose recipe the native path computes: q/k/v projections, optional
    per-head q/k RMSNorms (Qwen3), Llama's rotary embedding, the KV cache, softmax attention, o_proj."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mixtral.modeling_mixtral import MixtralAttention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    return {code_key(cls.forward) for cls in (LlamaAttention, MixtralAttention, Qwen3MoeAttention)}


def code_key(fn) -> tuple:
    code = fn.__code__
    return code.co_code, code.co_consts, code.co_names


def plain_forward(module: torch.nn.Module):
    """The forward of the module's own class, under its fast-decode class if it has one."""
    cls = type(module)
    return getattr(cls, "_plain_forward", cls.forward)


def is_llama_attention(module: torch.nn.Module) -> bool:
    """Same forward as Llama/Mixtral/Qwen3-MoE attention, bias-free projections, q/k norms (if any)
    over one head, and the module's rotary helpers are Llama's (Qwen2-MoE has biases, OLMoE norms
    the whole projection, others rotate differently: they keep their own code)."""
    from transformers.models.llama import modeling_llama

    forward = plain_forward(module)
    if code_key(forward) not in _llama_attention_codes():
        return False
    helpers = forward.__globals__
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        if name not in helpers or code_key(helpers[name]) != code_key(getattr(modeling_llama, name)):
            return False
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(proj, torch.nn.Linear) and proj.bias is None for proj in projections):
        return False
    head_dim = getattr(module, "head_dim", 0)
    norms = [norm for name in ("q_norm", "k_norm") if (norm := getattr(module, name, None)) is not None]
    return (all(is_llama_rms_norm(norm) and norm.weight.numel() == head_dim for norm in norms)
            and len({norm.variance_epsilon for norm in norms}) <= 1)  # the kernel takes one epsilon


def _fast_attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                            attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
    """One token of Llama-style attention in three native calls (q/k/v with norms and rotary, the
    attention over the cache, o_proj) instead of ~60 small ops; anything else takes the module's
    own forward."""
    kernels = _native_kernels(hidden_states, self.q_proj.weight)
    cos, sin = position_embeddings
    if (kernels is None or attention_mask is not None or past_key_values is None
            or hidden_states.numel() != hidden_states.shape[-1] or cos.numel() != self.head_dim
            or cos.dtype != torch.bfloat16):
        return self._plain_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    eps = next((norm.variance_epsilon for norm in (q_norm, k_norm) if norm is not None), 0.0)  # one for both
    query, key, value = kernels.qkv_rope(
        hidden_states, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, eps, cos, sin,
        self.head_dim)
    key, value = past_key_values.update(key, value, self.layer_idx)
    out = kernels.attend(query, key, value, self.scaling)
    return self.o_proj(out.view(*hidden_states.shape[:-1], -1)), None


def _router_recipes() -> dict[tuple, tuple[bool, bool]]:
    """Router forwards whose arithmetic after the linear is known, by code: (always normalize the
    top-k weights, cast them back to the logits' dtype). Qwen3's code is shared by Qwen2-MoE,
    OLMoE and Qwen3-Next (normalizing when `norm_topk_prob`); Mixtral's keeps float32 weights."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return {code_key(Qwen3MoeTopKRouter.forward): (False, True), code_key(MixtralTopKRouter.forward): (True, False)}


def router_recipe(module: torch.nn.Module) -> tuple[bool, bool] | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 or not hasattr(module, "top_k"):
        return None
    return _router_recipes().get(code_key(plain_forward(module)))


def _fast_router_forward(self, hidden_states: torch.Tensor):
    """A top-k router whose one-token linear is the native GEMV (torch's kernel without oneDNN took
    ~45 us for a 64 x 1024 router: most of a layer's routing); softmax and top-k stay torch's."""
    kernels = _native_kernels(hidden_states, self.weight)
    if kernels is None or hidden_states.numel() != self.weight.shape[1]:
        return self._plain_forward(hidden_states)
    always_normalize, cast_back = self._moescope_recipe
    logits = kernels.gemv(self.weight, hidden_states.reshape(1, -1))
    top_value, top_index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
    if always_normalize or getattr(self, "norm_topk_prob", False):
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return logits, top_value.to(logits.dtype) if cast_back else top_value, top_index


_fast_classes: dict[type, type] = {}


def _fast_class(cls: type, forward) -> type:
    """A subclass of `cls` whose forward is `forward`, the original kept as `_plain_forward`."""
    if cls not in _fast_classes:
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (cls,), {"forward": forward, "_plain_forward": cls.forward})
    return _fast_classes[cls]


def experts_fusable(module: torch.nn.Module) -> bool:
    """The native MoE kernel computes exactly this experts module's recipe: concatenated gate/up
    ([2I, H], gate first), SiLU gate, down [H, I], no biases or extra norms (Qwen-MoE, Mixtral,
    OLMoE, DeepSeek-style experts). Decided once per module: it is asked every layer of every token."""
    fusable = module.__dict__.get("_moescope_fusable")
    if fusable is None:
        fusable = module._moescope_fusable = _fusable_recipe(module)
    return fusable


def _fusable_recipe(module: torch.nn.Module) -> bool:
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe

    return bool(getattr(module, "has_gate", False) and not module.has_bias and not module.is_transposed
            and not getattr(module, "has_post_expert_norm", False)
            and getattr(type(module), "_apply_gate", None) is moe._default_apply_gate
            and isinstance(module.act_fn, SiLUActivation | torch.nn.SiLU))


def _one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float | None) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query, key/value heads shared by groups of query heads."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()  # each group of heads meets its kv head
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())
    return out.to(query.dtype).reshape(batch, heads, 1, dim).transpose(1, 2)  # [batch, 1, heads, dim], as SDPA's wrapper


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one-query steps of a fast decode (no mask, no extras)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (_active and query.shape[2] == 1 and attention_mask is None and query.device.type == "cpu"
             and query.dtype != torch.float32 and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
             and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _one_query_attention(query, key, value, scaling), None


def patch_module(module: torch.nn.Module) -> bool:
    """Give `module` its fast-decode class if it has one (a plain linear, a Llama-style RMSNorm or
    attention); True if it has it now. Same parameters, same results outside fast steps."""
    cls = type(module)
    if cls is FastLinear or cls in _fast_classes.values():
        return True  # patched before (a live switch back on)
    if cls is torch.nn.Linear:
        module.__class__ = FastLinear
    elif is_llama_rms_norm(module):
        module.__class__ = _fast_class(cls, _fast_rms_norm_forward)
    elif is_llama_attention(module):
        module.__class__ = _fast_class(cls, _fast_attention_forward)
    elif (recipe := router_recipe(module)) is not None:
        module.__class__ = _fast_class(cls, _fast_router_forward)
        module._moescope_recipe = recipe
    else:
        return False
    return True


def install(model: torch.nn.Module) -> bool:
    """Start building the native kernels, let `model`'s plain linears, norms and Llama-style
    attention use them, and route other SDPA attention through `attention`; True if routed now."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for module in model.modules():
        patch_module(module)
    decode_kernels.start_build()

    if model.config._attn_implementation != "sdpa":
        return False
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # same masks as SDPA
    model.set_attn_implementation(ATTENTION_NAME)
    return model.config._attn_implementation == ATTENTION_NAME
