"""A GGUF file's metadata as a transformers config, for the architectures MoEScope maps.

transformers has a GGUF config mapping of its own, but it falls short for MoE files: with
transformers 5.23, a Qwen3-MoE GGUF from llama.cpp's `convert_hf_to_gguf.py` gets no
`moe_intermediate_size` (the file's `expert_feed_forward_length`) and so builds experts of the dense
FFN's width, which the file's tensors do not fit. The keys are mapped here, as the converter writes
them (`gguf.GGUFWriter.add_*`), into the config the original checkpoint had.
"""

from __future__ import annotations

from decimal import Decimal

import numpy as np

from engine.errors import CheckpointError, NotMoEError
from engine.model.gguf.file import GGUFModel

# GGUF architecture -> (transformers model_type, class), for the MoE families mapped here
ARCHITECTURES = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "llama": ("mixtral", "MixtralForCausalLM"),  # llama.cpp writes Mixtral as `llama` with experts
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    # DeepSeek-V3/R1, and V2/V2.5 (deepseek_v2) when the file has no routing correction bias: _deepseek_variant
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
SUPPORTED = ("qwen3moe (Qwen3-MoE), qwen2moe (Qwen2-MoE), llama with experts (Mixtral), gpt-oss, "
             "deepseek2 (DeepSeek-V2/V3/R1)")
SOFTMAX_GATING, SIGMOID_GATING = 1, 2  # gguf.ExpertGatingFuncType
CORRECTION_BIAS = "exp_probs_b.bias"  # DeepSeek-V3's e_score_correction_bias, as the converter names it


def unmapped_variant(architecture: str, arch_value, tensor_names) -> str | None:
    """Why a file of an architecture in ARCHITECTURES is still not mapped (a variant of it), from its
    metadata (`arch_value(key, default)`) and tensor names; None when it is mapped. The loader and the
    library both ask."""
    if architecture == "deepseek2":
        v3 = _deepseek_v3(tensor_names)
        gating = arch_value("expert_gating_func", None)
        if gating is not None and int(gating) != (SIGMOID_GATING if v3 else SOFTMAX_GATING):
            return (f"a deepseek2 GGUF routing by {'softmax' if v3 else 'sigmoid'} "
                    f"{'with' if v3 else 'without'} a correction bias, which neither DeepSeek-V2 nor V3 does; "
                    "open the original checkpoint")
    return None


def _deepseek_v3(tensor_names) -> bool:
    """A deepseek2 file is DeepSeek-V3/R1 when its routers carry the correction bias, else V2/V2.5. The
    gating key cannot decide it: the converter writes it only from `scoring_func`, which transformers'
    DeepSeek-V3 config does not keep (llama.cpp reads a missing key as V2's softmax)."""
    return any(name.endswith(CORRECTION_BIAS) for name in tensor_names)


def _need(model: GGUFModel, key: str):
    value = model.arch_value(key)
    if value is None:
        raise CheckpointError(f"{model.path.name} has no '{model.architecture}.{key}' in its metadata; "
                              "it was not written by llama.cpp's converter or is damaged")
    return value


def _decimal(value) -> float:
    """A float32 from the file as the decimal the source config had (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config(model: GGUFModel) -> dict:
    """The transformers config (as config.json would hold it) of a GGUF model, or one line saying why not."""
    arch = model.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{model.path.name} is a GGUF of architecture '{arch}', which MoEScope cannot map to a transformers "
            f"model yet; GGUF architectures that work: {SUPPORTED}")
    experts = int(model.arch_value("expert_count", 0) or 0)
    if experts == 0:
        raise NotMoEError(f"{model.path.name} ({arch}) is a dense model, not a mixture-of-experts model; MoEScope "
                          "offloads experts, so run dense models with a plain runner")
    model_type, cls = ARCHITECTURES[arch]
    hidden = int(_need(model, "embedding_length"))
    heads = int(_need(model, "attention.head_count"))
    embedding = model.tensors.get("token_embd.weight")
    vocab = int(model.arch_value("vocab_size", 0) or (embedding.shape[0] if embedding else 0))
    config: dict = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_need(model, "feed_forward_length")),
        "num_hidden_layers": int(_need(model, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.arch_value("attention.head_count_kv", heads)),
        "max_position_embeddings": int(model.arch_value("context_length", 4096)),
        "rms_norm_eps": _decimal(model.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": _decimal(model.arch_value("rope.freq_base", 1e4))},
        "vocab_size": vocab,
        "num_experts_per_tok": int(_need(model, "expert_used_count")),
        # llama.cpp ties the LM head to the embedding when the file has no output.weight
        "tie_word_embeddings": "output.weight" not in model.tensors,
        # the compute dtype of `--dtype auto`: the native decode kernels' (a GGUF's blocks say nothing of it)
        "dtype": "bfloat16",
    }
    head_dim = model.arch_value("attention.key_length") or model.arch_value("rope.dimension_count")
    if head_dim:
        config["head_dim"] = int(head_dim)
    for key, token in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = model.metadata.get(f"tokenizer.ggml.{token}_token_id")
        if value is not None:
            config[key] = int(value)
    if model_type == "mixtral":
        config["num_local_experts"] = experts
    elif model_type == "gpt_oss":
        config.update(_gpt_oss(model, experts))
    elif model_type == "deepseek_v3":
        config.update(_deepseek(model, experts, heads))
    else:
        config["num_experts"] = experts
        config["moe_intermediate_size"] = int(_need(model, "expert_feed_forward_length"))
        config["decoder_sparse_step"] = 1
        config["mlp_only_layers"] = []
        # llama.cpp's qwen3moe graph renormalises the top-k weights, its qwen2moe graph does not
        config["norm_topk_prob"] = model_type == "qwen3_moe"
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = int(_need(model, "expert_shared_feed_forward_length"))
    return config


def _rope(model: GGUFModel, default_theta: float) -> dict:
    """`rope_parameters` from the rope keys: the base frequency, and YaRN's parameters when it is set."""
    rope = {"rope_type": "default", "rope_theta": _decimal(model.arch_value("rope.freq_base", default_theta))}
    if model.arch_value("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=_decimal(_need(model, "rope.scaling.factor")),
                    original_max_position_embeddings=int(_need(model, "rope.scaling.original_context_length")),
                    beta_fast=_decimal(model.arch_value("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=_decimal(model.arch_value("rope.scaling.yarn_beta_slow", 1.0)))
    return rope


def _gpt_oss(model: GGUFModel, experts: int) -> dict:
    """gpt-oss's own keys. The converter writes the experts' width as `expert_feed_forward_length`, the
    sliding window, and YaRN's parameters but not `truncate`: set false, as gpt-oss's own config has it
    (llama.cpp's YaRN rounds the correction range, the model as published does not)."""
    rope = _rope(model, 150000.0)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return {
        "num_local_experts": experts,
        "intermediate_size": int(_need(model, "expert_feed_forward_length")),
        "sliding_window": int(_need(model, "attention.sliding_window")),
        "rope_parameters": rope,
        "attention_bias": True,
    }


def _deepseek(model: GGUFModel, experts: int, heads: int) -> dict:
    """DeepSeek-V2/V3's keys as `DeepseekV2Model.set_gguf_parameters` writes them. Their MLA is written as
    one shared KV head of width `kv_lora_rank + rope` (`head_count_kv` 1, `key_length`), with the
    per-head widths in `key_length_mla`/`value_length_mla` (files from before that split give them in
    `key_length`/`value_length`). `mscale` is not written: DeepSeek ships it equal to `mscale_all_dim`
    (0.1 x the YaRN log multiplier), as taken here. llama.cpp's deepseek2 rotates adjacent pairs, which
    is transformers' `rope_interleave` (V3) and complex rotation (V2); no rows are permuted. V2 picks its
    top-k from softmax scores, in groups when the file has them, and does not renormalise them."""
    variant = unmapped_variant(model.architecture, model.arch_value, model.tensors)
    if variant:
        raise CheckpointError(f"{model.path.name} is {variant}")
    v3 = _deepseek_v3(model.tensors)
    groups = int(model.arch_value("expert_group_count", 1))
    rope_dim = int(_need(model, "rope.dimension_count"))
    mla = model.arch_value("attention.key_length_mla") is not None
    key = int(_need(model, "attention.key_length_mla" if mla else "attention.key_length"))
    value = int(_need(model, "attention.value_length_mla" if mla else "attention.value_length"))
    rope = _rope(model, 10000.0)
    if rope["rope_type"] == "yarn":
        # ten times the multiplier, in decimal: the config's 0.707, not float32's 0.70699996
        log_mul = Decimal(str(np.float32(model.arch_value("rope.scaling.yarn_log_multiplier", 0.1))))
        rope["mscale"] = rope["mscale_all_dim"] = float(log_mul * 10)
    q_lora = model.arch_value("attention.q_lora_rank")
    variant = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": True,
               "norm_topk_prob": bool(model.arch_value("expert_weights_norm", False))} if v3 else {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy"}
    return variant | {
        "num_key_value_heads": heads,
        "head_dim": rope_dim,
        "n_routed_experts": experts,
        "n_shared_experts": int(model.arch_value("expert_shared_count", 0)),
        "moe_intermediate_size": int(_need(model, "expert_feed_forward_length")),
        "first_k_dense_replace": int(model.arch_value("leading_dense_block_count", 0)),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(_need(model, "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key - rope_dim,
        "v_head_dim": value,
        "routed_scaling_factor": _decimal(model.arch_value("expert_weights_scale", 1.0)),
        "n_group": groups,
        "topk_group": int(model.arch_value("expert_group_used_count", 1)),
        "rope_parameters": rope,
    }
