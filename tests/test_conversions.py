"""Checkpoints whose published layout needs transformers' weight conversions load exactly (issue 24):
dense weights built by a converter (Bailing-hybrid and Kimi-Linear conv kernels, Qwen4-exp's sharded
n-gram embedding, Sarvam-MoE's fused q/k/v split in three) and fused experts with interleaved
gate/up rows (Inkling-2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli.main import main as moescope
from engine.decode.runtime import MoERuntime
from engine.model.checkpoint import read_safetensors_header
from tests.helpers.checkpoints import dequantized_reference, greedy_reply, reference_generate, save_tiny_checkpoint

PROMPT = [1, 17, 42, 9, 77, 5]
NEW_TOKENS = 8
DENSE = {  # family -> the model weight a converter builds
    "bailing_hybrid": "model.layers.0.self_attn.conv1d.weight",
    "kimi_linear": "model.layers.0.self_attn.conv1d.weight",
    "qwen4_exp_text": "model.layers.0.ple.ple_embedding.ngram_embedding.weight",
    "sarvam_moe": "model.layers.0.self_attn.q_proj.weight",  # and k_proj, v_proj: one source, three weights
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, list[int]]]:
    """Each family's tiny checkpoint and stock transformers' greedy tokens on it."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family in (*DENSE, "inkling2_text"):
        path = save_tiny_checkpoint(family, root / family)
        out[family] = path, reference_generate(path, PROMPT, NEW_TOKENS)
    return out


def generate(path: Path, budget: str, store: str, expert_format: str = "original") -> tuple[list[int], MoERuntime]:
    return greedy_reply(path, PROMPT, NEW_TOKENS, budget=budget, store=store, dtype="float32", fast_decode=False,
                        expert_format=expert_format)


@pytest.mark.parametrize("store", ["disk", "ram"])
@pytest.mark.parametrize("budget", ["30%", "all"])
@pytest.mark.parametrize("family", list(DENSE))
def test_dense_weights_that_need_a_conversion_load_exactly(converted, family, budget, store):
    path, stock = converted[family]
    assert DENSE[family] not in read_safetensors_header(path / "model.safetensors")  # stored in parts
    tokens, runtime = generate(path, budget, store)
    assert DENSE[family] in runtime.layout.conversions
    assert tokens == stock


@pytest.mark.parametrize("store", ["disk", "ram"])
@pytest.mark.parametrize("budget", ["30%", "all"])
def test_interleaved_fused_experts_load_exactly(converted, budget, store):
    path, stock = converted["inkling2_text"]
    tokens, runtime = generate(path, budget, store)
    assert {piece.interleave_dim for piece in runtime.layout.pieces[0][0]} == {0, None}  # gate_up, down
    assert tokens == stock


def test_interleaved_experts_fill_slots_in_the_models_row_order(converted):
    # Each expert's slot holds exactly the weights stock transformers puts in the model.
    from transformers import AutoModelForCausalLM

    from engine.model.loader import build_model
    from engine.offload.store import DiskStore

    path, _ = converted["inkling2_text"]
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = build_model(path, device=torch.device("cpu"), dtype="float32", load_dense=False)
    layout = loaded.layout
    store = DiskStore(layout)
    slot = torch.empty(layout.slot_bytes, dtype=torch.uint8)
    try:
        for layer, module_path in enumerate(layout.module_paths):
            experts = stock.get_submodule(module_path)
            for expert in (0, layout.num_experts - 1):
                store.fill(layer, expert, slot)
                for p in layout.params:
                    value = slot[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
                    assert torch.equal(value, getattr(experts, p.name)[expert]), (module_path, expert, p.name)
    finally:
        store.close()


def test_interleaved_experts_convert_to_a_block_format(converted):
    # The conversion reads experts through the disk store, which both stores' slots come from.
    path, _ = converted["inkling2_text"]
    tokens, _ = generate(path, "30%", "disk", expert_format="8bit")
    assert tokens == dequantized_reference(path, PROMPT, NEW_TOKENS, "8bit")


def test_a_conversion_that_fails_names_the_tensor_and_the_operation(converted, tmp_path, capsys):
    source, _ = converted["kimi_linear"]
    broken = tmp_path / "kimi"
    broken.mkdir()
    for item in source.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "model.safetensors").unlink()
    tensors = load_file(source / "model.safetensors")
    key = "model.layers.0.self_attn.k_conv1d.weight"
    tensors[key] = tensors[key][..., :3].contiguous()  # a kernel of another width: cannot be concatenated
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})

    code = moescope(["generate", "--model", str(broken), "--prompt-ids", "1,2", "--raw", "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0
    assert err.startswith("moescope: error: cannot convert")
    assert key in err and "Concatenate(dim=0)" in err and "'model.layers.0.self_attn.conv1d.weight'" in err


def test_an_expert_conversion_that_cannot_be_sliced_is_named():
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    from engine.errors import CheckpointError
    from engine.model.conversions import expert_source

    rule = WeightConverter("mlp.experts.*.w1.weight", "mlp.experts.gate_up_proj",
                           operations=[MergeModulelist(dim=0), Transpose(1, 2)])
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.3.w1.weight'.*Transpose"):
        expert_source(rule, rule.source_patterns[0], "model.layers.0.mlp.experts.3.w1.weight")


def test_json_output_is_unchanged_for_converted_checkpoints(converted, capsys):
    # The CLI reports a converted checkpoint like any other.
    path, stock = converted["bailing_hybrid"]
    code = moescope(["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--raw",
                     "--max-new-tokens", str(NEW_TOKENS), "--exact", "--json", "--budget", "30%"])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["token_ids"] == stock
