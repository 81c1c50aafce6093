"""Tiny real checkpoints for tests: transformers configs + `save_pretrained`, plus a tokenizer.

Every family here carries `@use_experts_implementation` in transformers, so each one exercises a
different expert layout (separate gate/up, shared experts, dense first layers, fused transposed
biased experts) through the same engine code.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 128

FAMILIES: dict[str, dict] = {
    "mixtral": dict(
        model_type="mixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(  # with a gated shared expert
        model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2,
    ),
    "olmoe": dict(
        model_type="olmoe", hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    ),
    "deepseek_v3": dict(  # dense first layer, shared experts, grouped routing, MLA attention
        model_type="deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    ),
    "glm4_moe": dict(  # partial rotary, biased q/k/v, dense first layer, shared expert, grouped sigmoid routing
        model_type="glm4_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        partial_rotary_factor=0.5, attention_bias=True,
    ),
    "gpt_oss": dict(  # fused, transposed, interleaved gate/up, biased experts
        model_type="gpt_oss", hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
        sliding_window=16,  # the sliding layer's cache drops positions within a test's replies
    ),
}

# Families whose published layout needs one of transformers' weight conversions at load (saved with
# `save_pretrained`, which writes that layout back). Each needs a few fields the shrunk sizes break:
CONVERTED_FAMILIES: dict[str, dict] = {
    "bailing_hybrid": dict(  # q/k/v conv kernels on disk, one `conv1d.weight` in the model
        model_type="bailing_hybrid", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],  # the default (1 in 6) leaves no attention layer
        first_k_dense_replace=0, n_group=2, topk_group=1,  # default 8 groups of 1 expert cannot pick 2 per group
    ),
    "kimi_linear": dict(  # q/k/v conv kernels on disk, one `conv1d.weight` in the model
        model_type="kimi_linear", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},  # default 32 x 128 wide
    ),
    "qwen4_exp_text": dict(  # the n-gram embedding on disk in `split_ngram_parts` shards
        model_type="qwen4_exp_text", hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, hc_count=2, hc_lowrank=8, full_attention_interval=2,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=64, indexer_compress_ratio=4,
        ple_layer_ids=[1], ngram_vocab_size_base=1000, split_ngram_parts=4, heads_per_ngram=2,  # ids are 1-based
    ),
    "sarvam_moe": dict(  # one fused q/k/v matrix on disk, split by size into q_proj, k_proj, v_proj (GQA)
        model_type="sarvam_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=0, n_group=2, topk_group=1,
    ),
    "inkling2_text": dict(  # fused experts with gate/up rows interleaved (`w13_weight`), a padded head
        model_type="inkling2_text", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4,
        rel_extent=64, unpadded_vocab_size=VOCAB,  # the default is the real model's 200058 rows
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template, small enough for a 128-token vocabulary."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(family: str, **overrides):
    # other families: the overrides give the config
    kw = dict(FAMILIES.get(family) or CONVERTED_FAMILIES.get(family) or {"model_type": family})
    kw.update(vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def save_tiny_checkpoint(family: str, path: Path, *, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **overrides), dtype=torch.float32)
    # Random init gives near-uniform logits; widen them so greedy argmax is far from ties.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def reference_generate(path: Path, prompt_ids: list[int], max_new_tokens: int, dtype=torch.float32,
                       generation_kwargs: dict | None = None, **load) -> list[int]:
    """Plain transformers, everything in memory, greedy: the ground truth (`load`: more from_pretrained
    arguments; `generation_kwargs`: more generate arguments, e.g. a repetition penalty)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0, **(generation_kwargs or {}))
    return out[0, len(prompt_ids):].tolist()


def greedy_reply(path: Path, prompt_ids: list[int], max_new_tokens: int, progress=None, **settings):
    """MoEScope's greedy reply with these load settings, and the (closed) runtime that gave it."""
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    runtime = MoERuntime(LoadModel(path=str(path), **settings), progress=progress)
    try:
        reply = Generator(runtime).generate(prompt_ids, SamplingSettings(temperature=0, max_new_tokens=max_new_tokens))
        return reply.token_ids, runtime
    finally:
        runtime.close()


def reference_with_margins(path: Path, prompt_ids: list[int], max_new_tokens: int,
                           dtype=torch.float32) -> tuple[list[int], list[torch.Tensor]]:
    """Plain transformers' greedy reply and, per step, its logits (float32)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [step[0].float() for step in out.scores]


def first_parting_is_a_near_tie(ours: list[int], reference: list[int], logits: list[torch.Tensor],
                                ulps: int = 2) -> bool:
    """A fast path (the same arithmetic in another order) may part from the reference only where the
    reference's own pick beat ours by at most `ulps` bf16 steps at the top logit's size; after the
    first parting the contexts differ, so nothing later is compared."""
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        if mine != theirs:
            scores = logits[step]
            ulp = 2.0 ** (torch.floor(torch.log2(scores[theirs].abs())).item() - 7)
            return (scores[theirs] - scores[mine]).item() <= ulps * ulp
    return True


# Wider versions of the families, whose expert matrices take the 256-element K-quant blocks
WIDE = {
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                      intermediate_size=256),
    "olmoe": dict(hidden_size=256, intermediate_size=256),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256),
    "glm4_moe": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256),
    "gpt_oss": dict(hidden_size=256, intermediate_size=256, head_dim=64),
}


def _round_trip(matrix: torch.Tensor, fmt, dtype) -> torch.Tensor:
    """[out, in] quantized to `fmt` (or llama.cpp's fallback for it) and dequantized back."""
    from engine.formats.blocks import format_for
    from engine.formats.dequantize import dequantize
    from engine.formats.quantize import quantize

    chosen = format_for(fmt, matrix.shape[1])
    if chosen is None:
        return matrix
    return dequantize(torch.from_numpy(quantize(matrix.float().numpy(), chosen)), chosen, matrix.shape[1], dtype)


def dequantized_reference(path: Path, prompt_ids: list[int], max_new_tokens: int, expert_format: str,
                          dtype=torch.float32, dense_format: str | None = None) -> list[int]:
    """Plain transformers on the model with its routed experts (and, with `dense_format`, its dense
    linear layers) quantized and dequantized back (engine.formats, the reference the gguf package
    checks): what MoEScope's quantized weights must reproduce."""
    from engine.formats.blocks import parse_format
    from engine.model.dense_quantize import dense_targets
    from engine.model.layout import is_experts_module

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    fmt = parse_format(expert_format)
    with torch.no_grad():
        experts = {name for name, module in model.named_modules() if is_experts_module(module)}
        if dense_format is not None:
            for _, linear in dense_targets(model, experts):
                linear.weight.copy_(_round_trip(linear.weight, parse_format(dense_format), dtype))
        for module in model.modules():
            if not is_experts_module(module) or fmt is None:
                continue
            for param in module.parameters(recurse=False):
                if param.dim() != 3:
                    continue  # biases stay as they are
                for expert in range(param.shape[0]):
                    matrix = param[expert].t() if module.is_transposed else param[expert]  # [out, in]
                    back = _round_trip(matrix, fmt, dtype)
                    param[expert].copy_(back.t() if module.is_transposed else back)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def tree_snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Names, sizes and modification times of everything under `path` (to prove nothing was written)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def set_config_field(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def write_large_qwen3_moe(path: Path, *, layers: int = 6, experts: int = 64, hidden: int = 1024,
                          expert_intermediate: int = 512, vocab: int = 1024, shard_bytes: int = 600 * 2**20) -> Path:
    """A Qwen3-MoE-shaped bf16 checkpoint with >= 1 GiB of experts, written shard by shard.

    Written with safetensors directly, in the Hub's per-expert naming, so the test process never
    holds more than one shard; the values are random but finite.
    """
    from safetensors.torch import save_file

    from bench.large_checkpoint import meta_model, random_bf16

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=expert_intermediate,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=experts,
        num_experts_per_tok=8, vocab_size=vocab, max_position_embeddings=512, dtype="bfloat16",
        eos_token_id=vocab - 1, bos_token_id=1, tie_word_embeddings=False,
    )
    meta = meta_model(config, path)
    rand = random_bf16()
    tensors: dict[str, torch.Tensor] = {}
    for name, p in meta.state_dict().items():
        if ".experts." in name:
            continue
        tensors[name] = torch.ones(p.shape, dtype=torch.bfloat16) if "norm" in name else rand(p.shape)
    proj_shapes = {"gate_proj": (expert_intermediate, hidden), "up_proj": (expert_intermediate, hidden),
                   "down_proj": (hidden, expert_intermediate)}
    blocks = {proj: rand((experts, *shape)) for proj, shape in proj_shapes.items()}  # reused across layers
    for layer in range(layers):
        for e in range(experts):
            for proj in proj_shapes:
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = blocks[proj][e].clone()

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if size + t.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def save_endless_checkpoint(path: Path) -> Path:
    """The tiny Mixtral with no EOS anywhere (config, generation config, tokenizer): every reply runs to
    max tokens, so there is always a reply to act on mid-stream."""
    save_tiny_checkpoint("mixtral", path, eos_token_id=None)
    tokenizer_config = path / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config.pop("eos_token", None)  # the engine falls back to the tokenizer's EOS
    tokenizer_config.write_text(json.dumps(config))
    return path
