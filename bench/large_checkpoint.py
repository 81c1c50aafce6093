"""Large synthetic Qwen3-MoE checkpoints, written shard by shard and tensor by tensor, so that a
checkpoint many times the machine's free memory is built in a few hundred MiB of it.

Tensor names and shapes are transformers' (read from the model built on the meta device), the
experts in the Hub's per-expert naming; values are random and finite. The experts cycle through a
pool of `POOL` random experts per projection: their bytes cost the same to read, convert and
multiply as all-distinct ones, and the build does not spend minutes drawing random numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.synthetic import CACHE_DIR

POOL = 8  # distinct random experts per projection

# Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768 top-8, 32 query / 4 key-value heads of
# 128) with 7 layers and an 80K vocabulary: 9.4 GB in bf16, 8.5 GB of it experts.
SHAPES: dict[str, dict] = {
    "qwen3moe-9g": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=7,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                        num_experts_per_tok=8, vocab_size=81920),
    # the same at a quarter of the experts, for a quicker run
    "qwen3moe-2g": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=7,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=32,
                        num_experts_per_tok=8, vocab_size=32768),
    # 50 MB, for the bench's own end-to-end test
    "qwen3moe-tiny": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                          num_experts_per_tok=4, vocab_size=4096),
}


def build_large(name: str, root: Path = CACHE_DIR, **shape) -> Path:
    """The checkpoint folder of a named shape (or `shape` given here), built on first use."""
    target = root / f"{name}-bfloat16"
    if (target / ".complete").exists():
        return target
    write_qwen3_moe(target, **(SHAPES.get(name, {}) | shape))
    (target / ".complete").touch()
    return target


def meta_model(config, path: Path):
    """`config` saved at `path`, and the model it builds on the meta device (its tensors' names and shapes)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def random_bf16(seed: int = 0):
    """A maker of small random bf16 tensors (finite, like trained weights' scale), seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(shape) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    return rand


def write_qwen3_moe(path: Path, **shape) -> Path:
    """A bf16 Qwen3-MoE checkpoint of `shape` (config fields) at `path`: one shard a decoder layer."""
    import torch
    from transformers import AutoConfig

    from engine.model.safetensors_writer import StreamedSafetensors

    config = AutoConfig.for_model("qwen3_moe", **shape, max_position_embeddings=4096, dtype="bfloat16",
                                  architectures=["Qwen3MoeForCausalLM"],  # what llama.cpp's converter reads
                                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    meta = meta_model(config, path)
    rand = random_bf16()
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    proj_shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    pool = {proj: [rand(s) for _ in range(POOL)] for proj, s in proj_shapes.items()}
    dense = {n: p.shape for n, p in meta.state_dict().items() if ".experts." not in n}
    shards: dict[str, dict[str, tuple]] = {}
    for name, shape_ in dense.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, {})[name] = (torch.bfloat16, tuple(shape_))
    for layer in range(config.num_hidden_layers):
        for e in range(config.num_experts):
            for proj, s in proj_shapes.items():
                shards[str(layer)][f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = (torch.bfloat16, s)
    weight_map = {}
    for i, specs in enumerate(shards.values()):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with StreamedSafetensors(path / file, specs) as out:
            for n, (_, s) in specs.items():
                if ".experts." in n:
                    e, proj = int(n.split(".")[5]), n.split(".")[6]
                    out.write(n, pool[proj][e % POOL])
                else:
                    out.write(n, torch.ones(s, dtype=torch.bfloat16) if "norm" in n else rand(s))
                weight_map[n] = file
    total = sum(s.stat().st_size for s in path.glob("*.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path
