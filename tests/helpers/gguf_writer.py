"""Tiny GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them, made with the `gguf` package's
`GGUFWriter` (CI has no llama.cpp): the same metadata keys, tensor names (the package's own
tensor-name map), fused `ffn_{gate,up,down}_exps` experts, Llama's q/k row permutation, F32 norms
and routers. Quantized with `gguf.quants.quantize` where it supports the type, with MoEScope's
quantizer for the K-quants (the package only dequantizes those); either way the reference weights
are the written bytes dequantized by the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers.checkpoints import VOCAB, make_tokenizer

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gpt_oss": "gpt-oss",
             "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}
FLOATS = {"F32", "F16", "BF16"}
EXPERT_STEMS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}

# Widths of whole 256-element blocks, so every GGUF quant type fits.
TINY = {
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True),  # llama.cpp's qwen3moe always renormalises the top-k weights
    "qwen2_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,  # with a gated shared expert
                      shared_expert_intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    # transposed experts with biases and interleaved gate/up, attention sinks, YaRN, a sliding window
    # shorter than the reply so both attention kinds matter
    "gpt_oss": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 8,
                                     "rope_theta": 150000.0}),
    # MLA (kv_b_proj split into attn_k_b/attn_v_b by the converter), a dense first layer, a shared
    # expert, grouped sigmoid routing with its correction bias, YaRN with mscale
    "deepseek_v3": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=3,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
                        qk_nope_head_dim=32, v_head_dim=32,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "rope_theta": 10000.0}),
    # V2-Lite's shape: no q LoRA (q_proj), softmax routing in groups, no correction bias
    "deepseek_v2": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=3,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        topk_method="group_limited_greedy", routed_scaling_factor=2.0, q_lora_rank=None,
                        kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "rope_theta": 10000.0}),
}


SEEDS = {"qwen3_moe": 0, "qwen2_moe": 2, "mixtral": 1, "gpt_oss": 3, "deepseek_v3": 4, "deepseek_v2": 5}  # random weights whose greedy replies vary over 32 tokens


def save_tiny_hf(family: str, path: Path) -> Path:
    """A tiny transformers checkpoint of `family` (TINY's geometry), as the GGUF's source."""
    torch.manual_seed(SEEDS[family])
    config = AutoConfig.for_model(family, vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=2,
                                  bos_token_id=1, pad_token_id=0, tie_word_embeddings=False, **TINY[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so greedy argmax is far from ties
        for name, p in model.named_parameters():
            p.mul_(0.5 if "norm" in name else 4.0)
    model.save_pretrained(path)
    return path


def _encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes as GGUFWriter takes them, the values the gguf package reads back) of `values` [..., columns]."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F32":
        return values, values
    if type_name == "F16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "BF16" or type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"):
        packed = gguf.quants.quantize(values, qtype)
    else:  # K-quants: the gguf package has no quantizer for them
        from engine.formats.blocks import FORMATS
        from engine.formats.quantize import quantize

        fmt = FORMATS[type_name.lower()]
        packed = quantize(values.reshape(-1, values.shape[-1]), fmt).reshape(*values.shape[:-1], -1)
    return packed, np.asarray(gguf.quants.dequantize(packed, qtype), dtype=np.float32).reshape(values.shape)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rows of q or k, grouped by head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    vocab = make_tokenizer().get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    by_id += ["ab"] + [f"<|extra_{i}|>" for i in range(VOCAB - len(by_id) - 1)]  # "ab": llama.cpp wants a merge
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(by_id)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") and len(t) > 1 else gguf.TokenType.NORMAL
                            for t in by_id])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)


def write_gguf(model_dir: Path, out: Path, *, experts: str | list[str] = "Q8_0", dense: str = "Q8_0",
               arch: str | None = None, split_max_tensors: int = 0) -> dict[str, np.ndarray]:
    """Write the checkpoint in `model_dir` as GGUF `out`: experts in type `experts` (or one type per
    layer for `ffn_down_exps`, gate and up in the first), 2-D dense weights in `dense`. Returns the
    model's weights as the file holds them, dequantized by the gguf package: model key -> values."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    family = config.model_type
    arch = arch or GGUF_ARCH[family]
    layers = config.num_hidden_layers
    down_types = experts if isinstance(experts, list) else [experts] * layers
    gate_up_type = down_types[0]
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else config.num_key_value_heads)  # MLA as one KV head
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    elif family != "gpt_oss":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family in ("qwen3_moe", "gpt_oss"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family == "gpt_oss":  # as llama.cpp's GptOssModel.set_gguf_parameters
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        _add_yarn(writer, config.rope_parameters)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if family.startswith("deepseek"):
        _add_deepseek_keys(writer, config)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    _add_tokenizer(writer)

    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    reference: dict[str, np.ndarray] = {}
    for key, tensor in model.state_dict().items():
        values = tensor.numpy()
        if ".experts." in key:
            reference[key] = _write_experts(writer, key, values, down_types, gate_up_type)
            continue
        if key.endswith("kv_b_proj.weight"):
            reference[key] = _write_kv_b(writer, key, values, config, dense)
            continue
        # as the converter renames it (ModelBase.modify_tensors)
        name = names.get_name(key.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        leaf = key.rpartition(".")[0].rpartition(".")[2]
        type_name = dense if values.ndim == 2 and leaf not in ("gate", "shared_expert_gate", "router") else "F32"
        type_name = _fitting(type_name, values)
        if name.endswith("attn_sinks"):
            name += ".weight"  # as llama.cpp's GptOssModel.filter_tensors
        packed, read = _encode(values, type_name)
        reference[key] = read
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            packed = _permute(packed, heads)
        writer.add_tensor(name, packed,
                          raw_dtype=None if type_name in ("F32", "F16") else gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _fitting(type_name: str, values: np.ndarray) -> str:
    """llama.cpp's quantizer falls back to Q8_0 for a K-quant whose rows are not whole 256-element blocks."""
    if type_name.endswith("_K") and values.shape[-1] % 256:
        return "Q8_0"
    return type_name


def _add_yarn(writer: gguf.GGUFWriter, rope: dict) -> None:
    """YaRN's keys as llama.cpp's TextModel.set_gguf_parameters writes them."""
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _add_deepseek_keys(writer: gguf.GGUFWriter, config) -> None:
    """As llama.cpp's DeepseekV2Model.set_gguf_parameters (and its base) writes them for DeepSeek-V2/V3
    (the gating from the original config's `scoring_func`: sigmoid for V3, softmax for V2)."""
    rope_dim, kv_lora = config.qk_rope_head_dim, config.kv_lora_rank
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + rope_dim)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_rope_dimension_count(rope_dim)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    v3 = config.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    _add_yarn(writer, config.rope_parameters)
    writer.add_rope_scaling_yarn_log_mul(0.1 * config.rope_parameters["mscale_all_dim"])


def _write_kv_b(writer: gguf.GGUFWriter, key: str, values: np.ndarray, config, type_name: str) -> np.ndarray:
    """MLA's kv_b_proj split per head into attn_k_b (nope rows, transposed) and attn_v_b, as llama.cpp's
    DeepseekV2Model.modify_tensors does; returns the matrix the file's parts dequantize to."""
    block = int(key.split(".layers.")[1].split(".")[0])
    heads, nope, kv_lora = config.num_attention_heads, config.qk_nope_head_dim, config.kv_lora_rank
    per_head = values.reshape(heads, -1, kv_lora)
    parts = {"attn_k_b": per_head[:, :nope].swapaxes(1, 2), "attn_v_b": per_head[:, nope:]}
    back = {}
    for stem, part in parts.items():
        part_type = _fitting(type_name, part)
        packed, back[stem] = _encode(part, part_type)
        writer.add_tensor(f"blk.{block}.{stem}.weight", packed,
                          raw_dtype=None if part_type in ("F32", "F16") else gguf.GGMLQuantizationType[part_type])
    return np.concatenate([back["attn_k_b"].swapaxes(1, 2), back["attn_v_b"]], axis=1).reshape(values.shape)


def _write_experts(writer: gguf.GGUFWriter, key: str, values: np.ndarray, down_types: list[str],
                   gate_up_type: str) -> np.ndarray:
    """One layer's fused experts tensor as ffn_{gate,up,down}_exps ([E, out, in], biases [E, out]);
    returns it as the file holds it, dequantized, in the model's layout. gpt-oss's matrices are [E, in,
    out] with gate/up interleaved: split as llama.cpp's GptOssModel.modify_tensors does."""
    block = int(key.split(".layers.")[1].split(".")[0])
    leaf = key.rpartition(".")[2]
    suffix = "bias" if leaf.endswith("_bias") else "weight"
    paired = writer.arch == "gpt-oss"
    transposed = paired and suffix == "weight"
    if transposed:
        values = values.swapaxes(-1, -2)
    if leaf.startswith("down_proj"):
        parts = {"down": (values, down_types[block] if suffix == "weight" else "F32")}
    else:
        type_name = gate_up_type if suffix == "weight" else "F32"
        half = values.shape[1] // 2
        gate, up = (values[:, ::2], values[:, 1::2]) if paired else (values[:, :half], values[:, half:])
        parts = {"gate": (gate, type_name), "up": (up, type_name)}
    back = []
    for stem, (part, type_name) in parts.items():
        packed, read = _encode(part, type_name)
        writer.add_tensor(f"blk.{block}.{EXPERT_STEMS[stem]}.{suffix}", packed,
                          raw_dtype=None if type_name in ("F32", "F16") else gguf.GGMLQuantizationType[type_name])
        back.append(read)
    if len(back) == 1:
        read = back[0]
    elif paired:
        read = np.stack(back, axis=2).reshape(back[0].shape[0], -1, *back[0].shape[2:])
    else:
        read = np.concatenate(back, axis=1)
    return read.swapaxes(-1, -2) if transposed else read


def gguf_reference_generate(model_dir: Path, weights: dict[str, np.ndarray], prompt_ids: list[int],
                            max_new_tokens: int) -> list[int]:
    """Stock transformers, greedy, on the checkpoint with the GGUF file's weights (dequantized by gguf)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for key, p in model.state_dict().items():
            p.copy_(torch.from_numpy(weights[key]).reshape(p.shape))
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
