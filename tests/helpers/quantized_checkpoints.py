"""Tiny checkpoints in the quantized formats models are published in: gpt-oss's MXFP4 experts
(`*_blocks` + `*_scales`, quantized with the gguf package's MXFP4 quantizer and laid out as gpt-oss
ships them) and block-wise FP8 (quantized with transformers' own `Fp8Quantize`, which runs on a CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import save_tiny_checkpoint, set_config_field

# Widths that are whole 32-element MXFP4 blocks and whole 128x128 FP8 tiles.
MXFP4_GPT_OSS = dict(hidden_size=64, intermediate_size=64, head_dim=16)
FP8_FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=8,
        num_experts_per_tok=2,
    ),
    "deepseek_v3": dict(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    ),
}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0], load_file(files[0])


def save_mxfp4_gpt_oss(path: Path, seed: int = 0) -> Path:
    """gpt-oss with its routed experts in MXFP4 as the published checkpoints hold them; the rest as saved."""
    from engine.formats.blocks import MXFP4
    from engine.formats.quantize import quantize
    from engine.formats.relay import openai_from_mxfp4

    save_tiny_checkpoint("gpt_oss", path, seed=seed, **MXFP4_GPT_OSS)
    file, tensors = _weights(path)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        matrix = tensors.pop(key).transpose(1, 2).contiguous()  # gpt-oss keeps [E, in, out]; blocks run along in
        experts, rows, columns = matrix.shape
        packed = torch.from_numpy(quantize(matrix.reshape(-1, columns).numpy(), MXFP4))
        blocks, scales = openai_from_mxfp4(packed)
        tensors[f"{key}_blocks"] = blocks.reshape(experts, rows, columns // 32, 16).contiguous()
        tensors[f"{key}_scales"] = scales.reshape(experts, rows, columns // 32).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    set_config_field(path, quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    })
    return path


def save_fp8(family: str, path: Path, seed: int = 0, drop_scale: str | None = None) -> Path:
    """`family` with every linear weight that is whole 128x128 tiles (attention, dense and expert MLPs;
    not the router, embeddings or head) in block-wise FP8, quantized by transformers' `Fp8Quantize`.
    `drop_scale`: leave out the scale of the first tensor whose name ends so (bad-input tests)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    save_tiny_checkpoint(family, path, seed=seed, **FP8_FAMILIES[family])
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128))))
    file, tensors = _weights(path)
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        skip = value.dim() != 2 or not key.endswith("proj.weight")
        out.update({key: value} if skip else quantizer._quantize_one(key, value))
    if drop_scale is not None:
        out.pop(next(k for k in out if k.endswith(drop_scale + "_scale_inv")))
    save_file(out, str(file), metadata={"format": "pt"})
    set_config_field(path, quantization_config=FP8_CONFIG)
    return path


def write_large_mxfp4_gpt_oss(path: Path, *, layers: int = 8, experts: int = 64, hidden: int = 1024,
                              intermediate: int = 1024) -> Path:
    """A gpt-oss-shaped checkpoint too big to matter in a test's memory, written directly: random
    MXFP4 codes with exponents near 2^-7 for the experts, small bf16 values for the rest (no model is
    materialised). For memory measurements; its replies mean nothing."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import make_config

    config = make_config("gpt_oss", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_local_experts=experts, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4,
                         head_dim=64, vocab_size=8192, dtype="bfloat16")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    for layer in range(-1, layers):  # one file per decoder layer, and one for the rest
        tensors: dict[str, torch.Tensor] = {}
        names = [n for n in state if (f".layers.{layer}." in n if layer >= 0 else ".layers." not in n)]
        for name in names:
            p = state[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, inputs, outputs = p.shape  # gpt-oss keeps [E, in, out]; the blocks run along in
                tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                          generator=generator)
                tensors[f"{name}_scales"] = torch.randint(118, 122, (e, outputs, inputs // 32), dtype=torch.uint8,
                                                          generator=generator)
            else:
                tensors[name] = (torch.randn(p.shape, generator=generator) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(path / f"model-{layer + 1:05d}.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    set_config_field(path, quantization_config={"quant_method": "mxfp4"})
    return path
