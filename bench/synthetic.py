"""Synthetic checkpoints of realistic geometry, built once and cached under bench/cache/.

Built with transformers (`from_config` + `save_pretrained`), so tensor names and layouts are
exactly what the Hub's checkpoints of that family look like; the weights are random.
"""

from __future__ import annotations

import json
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parent / "cache"

GEOMETRIES: dict[str, dict] = {
    # Fine-grained, Qwen3-MoE-like: many small experts, top-8 (issue 10's first geometry).
    "qwen3moe-64e": dict(
        model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
        num_experts_per_tok=8, vocab_size=16384, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # Small Qwen3-MoE-like model for `bench.run --quick` and the harness's smoke test.
    "qwen3moe-mini": dict(
        model_type="qwen3_moe", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=False,
    ),
    # Many layers of many experts (Qwen3-30B-A3B's 48 x 128, halved in depth, narrow): what grows with the
    # count of layers and experts in the engine's own memory (issue 62's fourth overhead shape), 1.1 GiB of experts.
    "qwen3moe-24l-128e": dict(
        model_type="qwen3_moe", hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=128,
        num_experts_per_tok=8, vocab_size=16384, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # Coarse, Mixtral-like: 8 big experts, top-2 (issue 10's second geometry, 1.1 GiB of experts).
    "mixtral-8e": dict(
        model_type="mixtral", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # The same with 12 layers: 1.55 GiB of experts, the size the budget sweep asks for.
    "mixtral-8e-12l": dict(
        model_type="mixtral", hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # gpt-oss-20b's proportions (hidden 2880, 32 experts of intermediate 2880 top-4, 64 query heads of
    # 64, 8 kv heads, attention sinks, sliding window on alternate layers, biased experts) with two
    # layers (one sliding, one full) and a 32K vocabulary to stay near 3.7 GB in bf16.
    "gptoss-32e": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"], vocab_size=32000,
        max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # DeepSeek-V3's proportions scaled down: MLA attention (q/kv LoRA ranks, 64 rotary + 128 plain
    # key dims), a dense first layer, 64 routed experts top-6 in 8 groups (top 4 groups), 2 shared
    # experts, sigmoid routing with its correction bias; about 2.7 GB in bf16.
    "deepseekv3-64e": dict(
        model_type="deepseek_v3", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768,
        num_hidden_layers=5, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}


def build_checkpoint(name: str, dtype: str = "bfloat16", root: Path = CACHE_DIR) -> Path:
    """The checkpoint folder for a named geometry, built on first use."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = root / f"{name}-{dtype}"
    marker = target / ".complete"
    if marker.exists():
        return target
    kw = dict(GEOMETRIES[name])
    config = AutoConfig.for_model(kw.pop("model_type"), **kw, eos_token_id=None, bos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():  # finite, modest values: real matmul work, no NaN shortcuts
            p.normal_(0.0, 0.02)
    model.save_pretrained(target)
    (target / "bench.json").write_text(json.dumps({"geometry": name, "dtype": dtype}))
    marker.touch()
    del model
    return target
