"""Checkpoints published quantized: gpt-oss's MXFP4 experts and block-wise FP8 (Qwen3-MoE,
DeepSeek-V3). Their experts stay in the checkpoint's format in the store, the slots and the
kernels, and greedy replies equal transformers' own CPU path (which dequantizes them), at every
budget, with both stores, without a byte written into the model folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.cli.main import main as moescope
from engine.decode.runtime import MoERuntime
from engine.formats.blocks import FP8, MXFP4
from engine.formats.dequantize import dequantize
from engine.formats.relay import RELAY_CHUNK_BLOCKS, fp8_from_tiles, mxfp4_from_openai
from tests.helpers.checkpoints import greedy_reply, reference_generate, set_config_field, tree_snapshot
from tests.helpers.quantized_checkpoints import save_fp8, save_mxfp4_gpt_oss

PROMPT = [5, 17, 33, 8, 61, 12, 40, 9]
NEW_TOKENS = 32
MODELS = ("gpt_oss-mxfp4", "qwen3_moe-fp8", "deepseek_v3-fp8")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {
        "gpt_oss-mxfp4": save_mxfp4_gpt_oss(root / "gpt_oss-mxfp4"),
        "qwen3_moe-fp8": save_fp8("qwen3_moe", root / "qwen3_moe-fp8"),
        "deepseek_v3-fp8": save_fp8("deepseek_v3", root / "deepseek_v3-fp8"),
    }


def generate(path: Path, **settings) -> tuple[list[int], MoERuntime]:
    return greedy_reply(path, PROMPT, NEW_TOKENS, **settings)


def dequantizing(model: str) -> dict:
    """transformers dequantizes FP8 at load on a CPU by itself; where a GPU is it keeps FP8 layers, whose
    kernels come from the Hub (the `kernels` package), so the reference asks for the dequantized model."""
    if not model.endswith("fp8"):
        return {}
    from transformers import FineGrainedFP8Config

    return {"quantization_config": FineGrainedFP8Config(weight_block_size=(128, 128), dequantize=True)}


@pytest.mark.parametrize("model", MODELS)
def test_greedy_replies_equal_transformers_dequantizing_the_checkpoint(checkpoints, model):
    path = checkpoints[model]
    expected = reference_generate(path, PROMPT, NEW_TOKENS, **dequantizing(model))
    before = tree_snapshot(path)
    fmt = MXFP4 if model.endswith("mxfp4") else FP8
    for budget in ("1", "30%", "all"):  # "1" byte: clamped to the minimum
        for store in ("disk", "ram"):
            tokens, runtime = generate(path, budget=budget, store=store)
            assert tokens == expected, (model, budget, store)
            # the experts stay in the checkpoint's format: slots, budget and store count its bytes
            assert runtime.layout.expert_format is fmt and runtime.format_names[0] == fmt.name
            matrices = [p for p in runtime.layout.params if p.fmt is not None]
            assert matrices and all(p.nbytes == fmt.packed_bytes(p.rows_columns) for p in matrices)
    assert tree_snapshot(path) == before  # nothing re-laid or converted into the user's folder


def test_mxfp4_blocks_hold_transformers_values():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 135, (3, 64, 4), dtype=torch.uint8, generator=generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128 columns, 64 rows]
    packed = torch.empty(3 * 64 * 4, MXFP4.block_bytes, dtype=torch.uint8)
    mxfp4_from_openai(blocks.reshape(-1, 16), scales.reshape(-1), packed)
    ours = dequantize(packed, MXFP4, 128).reshape(3, 64, 128)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_fp8_blocks_hold_transformers_values():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    hf = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)))
    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)) * 0.05
    quantized = Fp8Quantize(hf)._quantize_one("w.weight", weight)
    data, scale = quantized["w.weight"], quantized["w.weight_scale_inv"]
    theirs = Fp8Dequantize(hf)._dequantize_one(data, scale, torch.float32)
    packed = torch.empty(256, FP8.row_bytes(384), dtype=torch.uint8)
    fp8_from_tiles(data.view(torch.uint8), scale, packed)
    assert torch.equal(dequantize(packed, FP8, 384), theirs)


def test_a_relay_reads_its_source_from_the_tail_of_its_own_output():
    # The disk store reads a checkpoint's bytes into the end of the slot region they are relaid into
    # (no expert-sized temporaries); across many chunks the blocks must come out as from a separate source.
    generator = torch.Generator().manual_seed(2)
    n = 3 * RELAY_CHUNK_BLOCKS + 5
    blocks = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 135, (n,), dtype=torch.uint8, generator=generator)
    apart = torch.empty(n * MXFP4.block_bytes, dtype=torch.uint8)
    mxfp4_from_openai(blocks, scales, apart)
    shared = torch.empty(n * MXFP4.block_bytes, dtype=torch.uint8)
    shared[n:].copy_(blocks.reshape(-1))
    mxfp4_from_openai(shared[n:].view(n, 16), scales, shared)
    assert torch.equal(shared, apart)

    rows, cols = 1000, 640  # 5 blocks a row, row tiles of 128 (the last one short)
    weight = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator)
    scale_inv = torch.rand(8, cols // FP8.block, generator=generator)
    apart = torch.empty(rows, FP8.row_bytes(cols), dtype=torch.uint8)
    fp8_from_tiles(weight, scale_inv, apart)
    shared = torch.empty(rows * FP8.row_bytes(cols), dtype=torch.uint8)
    tail = shared[shared.numel() - weight.numel():]
    tail.copy_(weight.reshape(-1))
    fp8_from_tiles(tail.view(rows, cols), scale_inv, shared)
    assert torch.equal(shared.view(rows, -1), apart)


def test_an_fp8_tensor_without_its_scale_is_named(tmp_path, capsys):
    path = save_fp8("qwen3_moe", tmp_path / "no-scale", drop_scale="experts.3.up_proj.weight")
    before = tree_snapshot(path)
    assert moescope(["generate", "--model", str(path), "--prompt-ids", "5,6", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'model.layers.0.mlp.experts.3.up_proj.weight' has no scale" in err
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv" in err
    assert tree_snapshot(path) == before


def test_another_quantization_method_is_refused_naming_it(checkpoints, tmp_path, capsys):
    path = tmp_path / "awq"
    path.mkdir()
    for file in checkpoints["qwen3_moe-fp8"].iterdir():
        (path / file.name).symlink_to(file) if file.name != "config.json" else None
    config = json.loads((checkpoints["qwen3_moe-fp8"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config))
    set_config_field(path, quantization_config={"quant_method": "awq", "bits": 4})
    assert moescope(["info", "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'awq' quantized checkpoints are not supported" in err and "MXFP4" in err


@pytest.mark.parametrize("model", ["gpt_oss-mxfp4", "qwen3_moe-fp8"])
def test_info_and_the_fit_estimate_count_the_checkpoints_blocks(checkpoints, model, capsys):
    from engine.hub.estimate import estimate_folder

    path = checkpoints[model]
    assert moescope(["info", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_format"] == model.split("-")[1]
    estimate = estimate_folder(path)  # `moescope models info` and the library's fit verdict
    assert estimate.runnable and estimate.quantization == model.split("-")[1]
    _, runtime = generate(path, budget="all", store="disk")
    assert estimate.bytes_per_expert == runtime.layout.slot_bytes
    assert estimate.all_expert_bytes == runtime.layout.all_expert_bytes == info["all_expert_bytes"]


def test_mxfp4_experts_can_be_converted_to_fewer_bits(checkpoints):
    # the quantized store converts from the checkpoint's MXFP4 values, as from any original weights
    from tests.helpers.checkpoints import dequantized_reference

    path = checkpoints["gpt_oss-mxfp4"]
    expected = dequantized_reference(path, PROMPT, NEW_TOKENS, "q8_0")
    tokens, runtime = generate(path, budget="30%", store="disk", expert_format="q8_0")
    assert runtime.layout.expert_format.name == "q8_0" and runtime.format_names[0] == "q8_0"
    assert tokens == expected
