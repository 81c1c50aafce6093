"""GGUF files opened directly (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, DeepSeek-V2/V3): written here as
llama.cpp's converter writes them (tests/helpers/gguf_writer.py), experts read per expert from the
file in their quant type, and greedy replies equal stock transformers running the same weights
dequantized by the `gguf` package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.cli.main import main as moescope
from engine.decode.runtime import MoERuntime
from engine.model.dense_quantize import QuantizedLinear
from engine.model.gguf.convert import converted_root
from engine.offload.store import DiskStore
from engine.protocol import LoadModel
from tests.helpers.checkpoints import greedy_reply, tree_snapshot
from tests.helpers.gguf_writer import gguf_reference_generate, save_tiny_hf, write_gguf

PROMPT = [5, 17, 33, 8, 61, 12, 40, 9]
NEW_TOKENS = 32
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2")
TYPES = ("Q8_0", "Q4_K")
# (family, experts' type, dense type): every family in Q8_0 and Q4_K; gpt-oss also as llama.cpp ships it
# (MXFP4 experts, Q8_0 dense: `llama-quantize MXFP4_MOE`) and in BF16 (float experts transposed on read)
CASES = [(family, t, t) for family in FAMILIES for t in TYPES] + [("gpt_oss", "MXFP4", "Q8_0"),
                                                                   ("gpt_oss", "BF16", "BF16")]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """(family, experts' type) -> (user folder, GGUF file, the reference's greedy tokens)."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict = {"hf": {family: save_tiny_hf(family, root / family / "hf") for family in FAMILIES}}
    for family, type_name, dense in CASES:
        hf = made["hf"][family]
        folder = root / family / type_name
        folder.mkdir()
        path = folder / f"tiny-{family}-{type_name}.gguf"
        weights = write_gguf(hf, path, experts=type_name, dense=dense)
        made[family, type_name] = (folder, path, gguf_reference_generate(hf, weights, PROMPT, NEW_TOKENS))
    return made


def generate(path: Path, progress=None, **settings) -> tuple[list[int], MoERuntime]:
    settings.setdefault("dtype", "float32")
    return greedy_reply(path, PROMPT, NEW_TOKENS, progress, **settings)


@pytest.mark.parametrize(("family", "type_name", "dense"), CASES)
def test_greedy_replies_equal_transformers_on_the_files_weights(models, family, type_name, dense):
    folder, path, expected = models[family, type_name]
    before = tree_snapshot(folder)
    for budget, store in (("1", "disk"), ("30%", "ram"), ("30%", "disk"), ("all", "ram")):
        tokens, runtime = generate(path, budget=budget, store=store)
        assert tokens == expected, (family, type_name, budget, store)
    # experts were read from the file itself, in its quant type; dense matrices kept their blocks
    assert {piece.file for per_layer in runtime.layout.pieces for e in per_layer for piece in e} == {path}
    floats = ("BF16", "F16")
    assert runtime.format_names == tuple("original" if t in floats else t.lower() for t in (type_name, dense))
    assert any(isinstance(m, QuantizedLinear) for m in runtime.model.modules()) == (dense not in floats)
    assert tree_snapshot(folder) == before  # nothing written beside the user's file


@pytest.mark.parametrize("type_name", ["BF16", "F16"])
def test_float_experts_are_read_from_the_file_and_converted_to_the_compute_dtype(models, tmp_path, type_name):
    hf = models["hf"]["qwen3_moe"]
    path = tmp_path / f"float-{type_name}.gguf"
    weights = write_gguf(hf, path, experts=type_name, dense=type_name)
    tokens, runtime = generate(path, budget="30%", store="disk")
    assert tokens == gguf_reference_generate(hf, weights, PROMPT, NEW_TOKENS)
    assert runtime.format_names == ("original", "original") and not runtime.layout.quantized
    assert {piece.file for per_layer in runtime.layout.pieces for e in per_layer for piece in e} == {path}


def test_budget_and_info_count_the_files_bytes(models, capsys):
    _, path, _ = models["qwen3_moe", "Q4_K"]
    reader = gguf.GGUFReader(path)
    expert_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    _, runtime = generate(path, budget="all")
    assert runtime.layout.all_expert_bytes == expert_bytes  # each expert's Q4_K bytes, nothing expanded
    assert runtime.cache.budget_bytes == expert_bytes
    assert moescope(["info", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_format"] == "q4_k" and info["all_expert_bytes"] == expert_bytes
    assert info["architecture"] == "Qwen3MoeForCausalLM" and info["num_experts"] == 8 and info["top_k"] == 2


def test_the_tokenizer_comes_from_the_file(models):
    _, path, _ = models["mixtral", "Q8_0"]
    runtime = MoERuntime(LoadModel(path=str(path), dtype="float32"))
    try:
        ids = runtime.tokenizer.encode("hello world", add_special_tokens=False)
        assert runtime.tokenizer.decode(ids) == "hello world"
        assert runtime.tokenizer.eos_token_id == 2
    finally:
        runtime.close()


def test_a_gguf_without_its_suffix_opens_as_ollamas_blobs_are_named(models, tmp_path):
    _, path, expected = models["mixtral", "Q8_0"]
    blob = tmp_path / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir()
    blob.symlink_to(path)
    tokens, runtime = generate(blob, budget="30%")
    assert tokens == expected and runtime.tokenizer is not None


def test_a_split_set_opens_from_its_first_part_and_a_missing_part_is_named(models, tmp_path, capsys):
    hf = models["hf"]["mixtral"]
    weights = write_gguf(hf, tmp_path / "tiny.gguf", experts="Q8_0", split_max_tensors=12)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) > 2
    tokens, _ = generate(parts[0], budget="30%")
    assert tokens == gguf_reference_generate(hf, weights, PROMPT, NEW_TOKENS)
    parts[1].unlink()
    assert moescope(["info", "--model", str(parts[0])]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"moescope: error: '{parts[0].name}' is part of a split GGUF set of {len(parts)} files, and "
                   f"{parts[1].name} is missing from {tmp_path}; download every part into the same folder")


def test_a_quant_type_without_a_kernel_is_converted_once_and_said(models, tmp_path, capsys):
    folder = tmp_path / "user"
    folder.mkdir()
    path = folder / "q4_1.gguf"
    write_gguf(models["hf"]["qwen3_moe"], path, experts="Q4_1", dense="Q8_0")
    before = tree_snapshot(folder)
    assert moescope(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "converted once" in line]
    assert len(notes) == 1 and "from Q4_1 to Q5_0 (MoEScope has no kernel for Q4_1)" in notes[0]
    assert str(converted_root()) in notes[0]
    assert tree_snapshot(folder) == before
    seen: list[str] = []
    _, runtime = generate(path, progress=lambda f, what: seen.append(what))
    assert not any("converting" in line for line in seen)  # reused
    assert runtime.layout.expert_format.name == "q5_0"
    assert all(p.file.parent.parent == converted_root() for e in runtime.layout.pieces[0] for p in e)


def test_layers_in_different_types_keep_each_its_own_type(models, tmp_path):
    # llama.cpp's Q4_K_M gives some layers' ffn_down_exps Q6_K and the others Q4_K: every layer is
    # read from the file in its own type (slots sized for the widest), nothing is converted
    hf = models["hf"]["mixtral"]
    path = tmp_path / "mixed.gguf"
    weights = write_gguf(hf, path, experts=["Q4_K", "Q6_K", "Q4_K"])
    expected = gguf_reference_generate(hf, weights, PROMPT, NEW_TOKENS)
    seen: list[str] = []
    for budget, store in (("1", "disk"), ("30%", "ram"), ("all", "ram")):
        tokens, runtime = generate(path, progress=lambda f, what: seen.append(what), budget=budget, store=store)
        assert tokens == expected, (budget, store)
    layout = runtime.layout
    down = [next(p for p in layout.params_at(layer) if p.name == "down_proj") for layer in range(layout.num_layers)]
    assert [p.fmt.name for p in down] == ["q4_k", "q6_k", "q4_k"]
    assert down[0].nbytes < down[1].nbytes and down[1].nbytes == next(p.nbytes for p in layout.params
                                                                        if p.name == "down_proj")
    assert {p.fmt.name for p in layout.params} == {"q4_k", "q6_k"}  # the slot: the widest of each
    assert {piece.file for per_layer in layout.pieces for e in per_layer for piece in e} == {path}
    assert not any("converting" in line for line in seen) and runtime.format_notes == []
    # a miss moves the layer's own bytes: the Q4_K layer's expert is the smaller one
    gate_up = next(p.nbytes for p in layout.params if p.name == "gate_up_proj")
    disk = DiskStore(layout)
    assert disk.fill(0, 0, torch.empty(layout.slot_bytes, dtype=torch.uint8)) == gate_up + down[0].nbytes
    disk.close()


def _write_minimal(path: Path, arch: str, **arch_values) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in arch_values.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_we_cannot_map_is_named_with_the_ones_that_work(tmp_path, capsys):
    path = _write_minimal(tmp_path / "other.gguf", "falcon", block_count=1)
    before = tree_snapshot(tmp_path)
    assert moescope(["info", "--model", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "moescope: error: other.gguf is a GGUF of architecture 'falcon', which MoEScope cannot map to a transformers "
        "model yet; GGUF architectures that work: qwen3moe (Qwen3-MoE), qwen2moe (Qwen2-MoE), llama with experts "
        "(Mixtral), gpt-oss, deepseek2 (DeepSeek-V2/V3/R1)")
    dense = _write_minimal(tmp_path / "dense.gguf", "llama", block_count=1, embedding_length=8)
    assert moescope(["info", "--model", str(dense)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moescope: error: dense.gguf (llama) is a dense model") and "\n" not in err
    assert set(tree_snapshot(tmp_path)) == set(before) | {"dense.gguf"}


def test_a_deepseek2_gguf_routing_like_neither_v2_nor_v3_is_refused_in_one_line(tmp_path, capsys):
    # llama.cpp writes DeepSeek-V2 and V3 both as deepseek2: V3's routers carry a correction bias and
    # route by sigmoid, V2's by softmax without one. A file that mixes them has no transformers model.
    path = _write_minimal(tmp_path / "odd.gguf", "deepseek2", block_count=1, embedding_length=8, feed_forward_length=8,
                          **{"attention.head_count": 1, "expert_count": 8, "expert_used_count": 2,
                             "expert_gating_func": 2})
    assert moescope(["info", "--model", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "moescope: error: odd.gguf is a deepseek2 GGUF routing by sigmoid without a correction bias, which "
        "neither DeepSeek-V2 nor V3 does; open the original checkpoint")


def test_a_truncated_file_is_named(models, tmp_path, capsys):
    _, path, _ = models["mixtral", "Q8_0"]
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(path.stat().st_size * 2 // 3))
    assert moescope(["generate", "--model", str(cut), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moescope: error: {cut} is truncated") and err.endswith("download it again")
    assert "\n" not in err
    header_only = tmp_path / "header.gguf"
    shutil.copyfile(path, header_only)
    with open(header_only, "r+b") as handle:
        handle.truncate(100)
    assert moescope(["info", "--model", str(header_only)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moescope: error: {header_only} is truncated") and "\n" not in err


def test_the_native_decode_paths_run_a_gguf_in_bf16(models, kernels):
    _, path, _ = models["mixtral", "Q4_K"]
    tokens, runtime = generate(path, dtype="auto", budget="all", device="cpu")  # the native kernels are the CPU's
    assert len(tokens) == NEW_TOKENS and runtime.dtype.is_floating_point
    assert "native" in runtime.decode_path.lower() or "whole" in runtime.decode_path.lower(), runtime.decode_path


@pytest.mark.process
def test_the_engine_process_opens_a_gguf_and_streams_the_same_reply(models):
    from engine import protocol as p
    from tests.helpers.engine_events import started_client

    _, path, expected = models["qwen3_moe", "Q4_K"]
    client, log = started_client()
    try:
        client.send(p.LoadModel(path=str(path), dtype="float32", budget="30%", store="disk"))
        loaded = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
        assert isinstance(loaded, p.ModelLoaded), loaded
        assert loaded.expert_format == "q4_k" and loaded.name == path.name
        client.send(p.Generate("g1", prompt_ids=PROMPT, sampling=p.SamplingSettings(temperature=0,
                                                                                 max_new_tokens=NEW_TOKENS)))
        done = log.wait_for(lambda e: isinstance(e, p.Done) and e.request_id == "g1", 120)
        assert done.token_ids == expected
    finally:
        client.stop()
