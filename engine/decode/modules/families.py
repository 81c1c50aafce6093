"""Which transformers classes the native decode kernels compute, recognised by class, not by code.

Each entry names classes of transformers' own model modules (`transformers.models.<module>`)
whose arithmetic a native kernel reproduces: Llama-style RMSNorms, Llama-style attention (q/k/v,
optional per-head q/k norms, Llama's rotary embedding, softmax attention, o_proj), top-k routers
with a known recipe after the linear, and the decoders the whole-token step runs end to end.
A module qualifies when its class is one of these (checked exactly, so a subclass with its own
forward does not), plus the structural checks of its path (bias-free projections, one epsilon...).

A transformers release that rewrites one of these forwards does not switch anything off silently:
tests/test_decode_families.py pins which families take which path and compares every listed
class's output with its native counterpart, so a change in arithmetic fails there.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch

from engine.model.dense_quantize import QuantizedLinear


class RouterRecipe(NamedTuple):
    """What a top-k router computes after its linear."""

    always_normalize: bool  # renormalise the top-k weights (else only when the router's `norm_topk_prob`)
    cast_back: bool  # the weights in the logits' dtype (else float32)
    # top-k of the biased logits, then a softmax over those k in the logits' dtype (GPT-OSS), instead
    # of a float32 softmax over all experts, then top-k
    softmax_of_top: bool = False


# Qwen3-MoE's routers renormalise when `norm_topk_prob` and cast back; Mixtral's always renormalise
# and keep float32 weights; GPT-OSS's take the top k of the biased logits, then their softmax.
QWEN3_ROUTER = RouterRecipe(False, True)
MIXTRAL_ROUTER = RouterRecipe(True, False)
GPT_OSS_ROUTER = RouterRecipe(True, True, softmax_of_top=True)


@dataclass(frozen=True)
class Family:
    """The classes of one transformers model module that the native kernels compute."""

    module: str  # transformers.models.<module>.modeling_<module>
    norms: tuple[str, ...] = ()  # Llama-style RMSNorm classes
    attention: tuple[str, ...] = ()  # Llama-style attention classes
    routers: tuple[tuple[str, RouterRecipe], ...] = ()  # top-k router classes and their recipe
    # the whole-token step: (causal LM, decoder, decoder layer, sparse MoE block) classes; a block
    # with a `shared_expert` (or `shared_experts`) adds it, scaled by sigmoid(`shared_expert_gate`)
    # where it has one; the block's router is its `gate` or `router`
    whole_token: tuple[str, str, str, str] | None = None
    # Llama-style attention that only the whole-token step computes: q/k/v projections with biases
    # (Qwen2-MoE), q/k norms over the whole projection before the rotary embedding (OLMoE), or a
    # rotary embedding over part of each head (GLM-4-MoE)
    whole_token_attention: tuple[str, ...] = ()
    # DeepSeek-V3-style multi-head latent attention whose cache holds the compressed latents: one-query
    # steps attend over the latents with kv_b_proj absorbed (engine.decode.modules.latent_attention)
    latent_attention: tuple[str, ...] = ()
    # the family's norms multiply by their weight in float32 and round once (GPT-OSS), not Llama's way
    norms_round_once: bool = False
    # DeepSeek-V3-style routers only the whole-token step computes: float32 logits, sigmoid scores plus
    # a correction bias, the best groups of experts, then the top k within them
    grouped_routers: tuple[str, ...] = ()
    # SiLU-gated dense MLPs the whole-token step runs in place of an MoE block (DeepSeek's first layers)
    dense_mlps: tuple[str, ...] = ()


FAMILIES = (
    Family("qwen3_moe", ("Qwen3MoeRMSNorm",), ("Qwen3MoeAttention",), (("Qwen3MoeTopKRouter", QWEN3_ROUTER),),
           ("Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeSparseMoeBlock")),
    Family("mixtral", ("MixtralRMSNorm",), ("MixtralAttention",), (("MixtralTopKRouter", MIXTRAL_ROUTER),),
           ("MixtralForCausalLM", "MixtralModel", "MixtralDecoderLayer", "MixtralSparseMoeBlock")),
    Family("qwen2_moe", ("Qwen2MoeRMSNorm",), (), (("Qwen2MoeTopKRouter", QWEN3_ROUTER),),
           ("Qwen2MoeForCausalLM", "Qwen2MoeModel", "Qwen2MoeDecoderLayer", "Qwen2MoeSparseMoeBlock"),
           whole_token_attention=("Qwen2MoeAttention",)),
    Family("olmoe", ("OlmoeRMSNorm",), (), (("OlmoeTopKRouter", QWEN3_ROUTER),),
           ("OlmoeForCausalLM", "OlmoeModel", "OlmoeDecoderLayer", "OlmoeSparseMoeBlock"),
           whole_token_attention=("OlmoeAttention",)),
    # attention with sinks and biased projections, experts with biases and a clamped SwiGLU
    Family("gpt_oss", ("GptOssRMSNorm",), ("GptOssAttention",), (("GptOssTopKRouter", GPT_OSS_ROUTER),),
           ("GptOssForCausalLM", "GptOssModel", "GptOssDecoderLayer", "GptOssMLP"), norms_round_once=True),
    Family("qwen3_next", (), (), (("Qwen3NextTopKRouter", QWEN3_ROUTER),)),
    Family("qwen4_exp", (), (), (("Qwen4ExpTextTopKRouter", QWEN3_ROUTER),)),
    Family("flex_olmo", (), (), (("FlexOlmoTopKRouter", QWEN3_ROUTER),)),
    Family("mellum", ("MellumRMSNorm",), ("MellumAttention",), (("MellumTopKRouter", QWEN3_ROUTER),)),
    Family("minimax", ("MiniMaxRMSNorm",), ("MiniMaxAttention",), (("MiniMaxTopKRouter", MIXTRAL_ROUTER),)),
    Family("aria", ("AriaTextRMSNorm",), ("AriaTextAttention",)),
    Family("dots1", ("Dots1RMSNorm",), ("Dots1Attention",)),
    Family("granitemoe", ("GraniteMoeRMSNorm",), ("GraniteMoeAttention",)),
    Family("granitemoeshared", ("GraniteMoeSharedRMSNorm",), ("GraniteMoeSharedAttention",)),
    Family("solar_open", ("SolarOpenRMSNorm",), ("SolarOpenAttention",)),
    Family("phimoe", (), ("PhimoeAttention",)),
    Family("deepseek_v2", ("DeepseekV2RMSNorm",), latent_attention=("DeepseekV2Attention",)),
    # MLA attention, grouped sigmoid routers, shared experts and dense first layers
    Family("deepseek_v3", ("DeepseekV3RMSNorm",), latent_attention=("DeepseekV3Attention",),
           whole_token=("DeepseekV3ForCausalLM", "DeepseekV3Model", "DeepseekV3DecoderLayer", "DeepseekV3MoE"),
           grouped_routers=("DeepseekV3TopkRouter",), dense_mlps=("DeepseekV3MLP",)),
    Family("deepseek_v32", ("DeepseekV32RMSNorm",)),
    # partial rotary and biased q/k/v (whole-token step only), grouped routers, shared experts, dense layers
    Family("glm4_moe", ("Glm4MoeRMSNorm",),
           whole_token=("Glm4MoeForCausalLM", "Glm4MoeModel", "Glm4MoeDecoderLayer", "Glm4MoeMoE"),
           whole_token_attention=("Glm4MoeAttention",), grouped_routers=("Glm4MoeTopkRouter",),
           dense_mlps=("Glm4MoeMLP",)),
    Family("glm4_moe_lite", ("Glm4MoeLiteRMSNorm",), latent_attention=("Glm4MoeLiteAttention",),
           whole_token=("Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel", "Glm4MoeLiteDecoderLayer", "Glm4MoeLiteMoE"),
           grouped_routers=("Glm4MoeLiteTopkRouter",), dense_mlps=("Glm4MoeLiteMLP",)),
    Family("glm_moe_dsa", ("GlmMoeDsaRMSNorm",)),
    Family("ernie4_5_moe", ("Ernie4_5_MoeRMSNorm",)),
    Family("dots3_note", ("Dots3NoteRMSNorm",)),
    Family("axk1", ("AXK1RMSNorm",)),
    Family("axk2", ("AXK2RMSNorm",)),
    Family("bailing_hybrid", ("BailingHybridRMSNorm",)),
    Family("cohere2_moe", ("Cohere2MoeRMSNorm",)),
    Family("exaone_moe", ("ExaoneMoeRMSNorm",)),
    Family("granitemoe_swa", ("GraniteMoeSWARMSNorm",)),
    Family("granitemoehybrid", ("GraniteMoeHybridRMSNorm",)),
    Family("hunyuan_v1_moe", ("HunYuanMoEV1RMSNorm",)),
    Family("hy_v3", ("HYV3RMSNorm",)),
    Family("hy_v4", ("HYV4RMSNorm",)),
    Family("inkling", ("InklingRMSNorm",)),
    Family("jamba", ("JambaRMSNorm",)),
    Family("kimi_linear", ("KimiLinearRMSNorm",)),
    Family("kolibri1", ("Kolibri1RMSNorm",)),
    Family("laguna", ("LagunaRMSNorm",)),
    Family("lfm2_moe", ("Lfm2MoeRMSNorm",)),
    Family("mimo_v2_flash", ("MiMoV2FlashRMSNorm",)),
    Family("minimax_m2", ("MiniMaxM2RMSNorm",)),
    Family("zaya", ("ZayaRMSNorm",)),
)


def _module(name: str):
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:  # not in this transformers: its classes simply do not qualify
        return None


def _classes(family: Family, names) -> list[type]:
    module = _module(family.module)
    return [cls for name in names if module is not None and (cls := getattr(module, name, None)) is not None]


@cache
def listed(kind: str) -> frozenset[type]:
    """The classes every family names in its field `kind` ("norms", "attention", "latent_attention",
    "whole_token_attention", "grouped_routers", "dense_mlps")."""
    return frozenset(cls for f in FAMILIES for cls in _classes(f, getattr(f, kind)))


@cache
def norms_rounding_once() -> frozenset[type]:
    return frozenset(cls for f in FAMILIES if f.norms_round_once for cls in _classes(f, f.norms))


@cache
def router_recipes() -> dict[type, RouterRecipe]:
    return {cls: recipe for f in FAMILIES for (name, recipe) in f.routers for cls in _classes(f, (name,))}


@cache
def whole_token_classes() -> dict[str, frozenset[type]]:
    """Per part ("causal_lm", "model", "layer", "block"): the classes the whole-token step runs."""
    parts: dict[str, set[type]] = {"causal_lm": set(), "model": set(), "layer": set(), "block": set()}
    for family in FAMILIES:
        if family.whole_token is None:
            continue
        for part, cls in zip(parts, _classes(family, family.whole_token), strict=False):
            parts[part].add(cls)
    return {part: frozenset(classes) for part, classes in parts.items()}


def own_class(module: torch.nn.Module) -> type:
    """The module's transformers class, under the native-kernel subclass it may have been given."""
    cls = type(module)
    return getattr(cls, "_moescope_plain", cls)


def is_llama_rms_norm(module: torch.nn.Module, rounding_once: bool = False) -> bool:
    """A Llama-style RMSNorm (x * rsqrt(mean(x^2) + eps) * weight), as most MoE families copy it;
    with `rounding_once`, also those that round only the weighted product (GPT-OSS's). Gemma-style
    (1 + weight) norms and others are not listed."""
    cls = own_class(module)
    return (cls in listed("norms") and (rounding_once or cls not in norms_rounding_once())
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter) and hasattr(module, "variance_epsilon"))


def norm_rounds_once(module: torch.nn.Module) -> bool:
    return own_class(module) in norms_rounding_once()


def is_llama_attention(module: torch.nn.Module, whole_token: bool = False) -> bool:
    """Llama-style attention (projections with or without biases, attention sinks where GPT-OSS has
    them) and q/k norms (if any) over one head with one epsilon; with `whole_token`, also the listed
    classes only the whole-token step computes, whose q/k/v carry biases (Qwen2-MoE) or whose q/k
    norms span the whole projection (OLMoE)."""
    classes = listed("attention") | (listed("whole_token_attention") if whole_token else frozenset())
    if own_class(module) not in classes:
        return False
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(is_linear(proj) for proj in projections):
        return False
    biases = [proj.bias for proj in projections[:3]]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return False  # the kernel takes biases for all three or none
    if getattr(getattr(module, "config", None), "clip_qkv", None) is not None:
        return False  # OLMoE's optional clamp of q/k/v
    head_dim = getattr(module, "head_dim", 0)
    norms = [norm for name in ("q_norm", "k_norm") if (norm := getattr(module, name, None)) is not None]
    if not all(is_llama_rms_norm(norm) for norm in norms) or len({norm.variance_epsilon for norm in norms}) > 1:
        return False  # the kernel takes one epsilon
    per_head = all(norm.weight.numel() == head_dim for norm in norms)
    full = (whole_token and len(norms) == 2 and module.q_norm.weight.numel() == module.q_proj.out_features
            and module.k_norm.weight.numel() == module.k_proj.out_features)
    return per_head or full


def attention_windows(model: torch.nn.Module) -> list[int | None]:
    """Each decoder layer's attention window, if it slides: the one its attention module was given
    (the config's field is not enough: Qwen2-MoE keeps one there with `use_sliding_window` off)."""
    return [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]


def is_latent_attention(module: torch.nn.Module) -> bool:
    """A listed MLA attention whose kv_b_proj is a plain bias-free linear (its weight is split per head)."""
    up = getattr(module, "kv_b_proj", None)
    return (own_class(module) in listed("latent_attention") and isinstance(up, torch.nn.Linear)
            and up.bias is None and is_linear(getattr(module, "o_proj", None)))


def is_linear(module: torch.nn.Module | None) -> bool:
    """A linear layer, its weight in bf16/fp32 or in a block format (engine.model.dense_quantize)."""
    return isinstance(module, torch.nn.Linear | QuantizedLinear)


def router_recipe(module: torch.nn.Module) -> RouterRecipe | None:
    """The recipe of a listed top-k router with a plain 2-D weight (and, where its recipe adds one,
    a bias); else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 or not hasattr(module, "top_k"):
        return None
    recipe = router_recipes().get(own_class(module))
    if recipe is not None and recipe.softmax_of_top != isinstance(getattr(module, "bias", None), torch.nn.Parameter):
        return None  # GPT-OSS's recipe adds its bias; the others have none
    return recipe


def whole_token_part(module: torch.nn.Module | None, part: str) -> bool:
    return module is not None and own_class(module) in whole_token_classes()[part]
