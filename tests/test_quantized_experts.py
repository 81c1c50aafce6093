"""Routed experts in a block format: converted once into MoEScope's cache folder, cached, moved and
computed quantized, and the replies equal plain transformers on the same model with its experts
quantized and dequantized back (the reference), for every family, budget and store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.main import main as moescope
from engine.decode.native.testing import forced_paths
from engine.decode.runtime import MoERuntime
from engine.errors import CheckpointError
from engine.formats.blocks import FORMATS
from engine.offload import quantized_store
from engine.protocol import LoadModel
from tests.helpers.checkpoints import (
    FAMILIES,
    WIDE,
    dequantized_reference,
    greedy_reply,
    save_tiny_checkpoint,
    tree_snapshot,
)

PROMPT = [5, 17, 33, 8, 61, 12, 40, 9]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    return {family: save_tiny_checkpoint(family, root / family, **WIDE[family]) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(wide) -> dict:
    cache: dict = {}

    def reference(family: str, fmt: str) -> list[int]:
        if (family, fmt) not in cache:
            cache[family, fmt] = dequantized_reference(wide[family], PROMPT, NEW_TOKENS, fmt)
        return cache[family, fmt]

    return reference


def generate(path, **settings) -> tuple[list[int], MoERuntime]:
    return greedy_reply(path, PROMPT, NEW_TOKENS, **settings)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q2_k"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_replies_equal_transformers_on_the_dequantized_experts(wide, references, family, fmt):
    expected = references(family, fmt)
    for budget, store in (("min", "disk"), ("30%", "ram"), ("all", "disk")):
        tokens, runtime = generate(wide[family], budget="1" if budget == "min" else budget, store=store,
                                   expert_format=fmt)
        assert tokens == expected, (family, fmt, budget, store)
        assert runtime.layout.expert_format is FORMATS[fmt]


@pytest.mark.parametrize("scratch", ["one expert", "whole layer"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_quantized_experts_run_grouped_as_on_a_gpu_and_stay_exact(wide, references, monkeypatch, family, scratch):
    # On a GPU a step's experts run grouped (a few launches a layer: the prompt's and each decode token's),
    # and quantized slots are first dequantized together into a bounded scratch; that path is
    # device-agnostic, so it is held to the reference here: hits and misses, biases and transposed
    # matrices (gpt-oss), shared experts, and a scratch too small for two experts (one at a time).
    from engine.decode.generation import Generator
    from engine.offload import expert_cache
    from engine.protocol import SamplingSettings

    if scratch == "one expert":
        monkeypatch.setattr(expert_cache, "GROUPED_SCRATCH_BYTES", 1)
    for budget in ("all", "30%"):
        runtime = MoERuntime(LoadModel(path=str(wide[family]), budget=budget, store="ram", device="cpu",
                                       fast_decode=False, expert_format="q4_k"))
        try:
            assert not runtime.cache.grouped  # on a CPU one expert at a time (oneDNN's matmuls are faster)
            runtime.cache.grouped = runtime.cache.decode_grouped = True
            reply = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
            assert reply.token_ids == references(family, "q4_k"), budget
            assert budget == "all" or runtime.counters.layer_misses.sum() > 0
            assert any(name.endswith("/grouped") for name in runtime.cache.reader._scratch)  # the grouped copies
        finally:
            runtime.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_mixed_quantization_of_experts_and_dense_weights(wide, family):
    # Experts at 4 bits, every other linear layer (not the routers) at 8: the replies are those of
    # transformers with both dequantized, and the dense layers hold only their blocks.
    expected = dequantized_reference(wide[family], PROMPT, NEW_TOKENS, "q4_k", dense_format="q8_0")
    tokens, runtime = generate(wide[family], budget="30%", store="disk", expert_format="q4_k", dense_format="8bit")
    assert tokens == expected
    from engine.model.dense_quantize import QuantizedLinear

    quantized = [name for name, m in runtime.model.named_modules() if isinstance(m, QuantizedLinear)]
    assert any(name.endswith(("q_proj", "q_a_proj")) for name in quantized)
    assert not any(name.rpartition(".")[2] in ("gate", "router") for name in quantized)  # routers stay
    # MLA's kv_b_proj stays a matrix: the absorbed one-token attention reads it per head
    assert not any(name.endswith("kv_b_proj") for name in quantized)
    assert family != "deepseek_v3" or any(name.endswith("kv_b_proj") for name, _ in runtime.model.named_modules())


def test_dense_conversion_is_cached_and_a_damaged_cache_is_not_trusted(tmp_path):
    """Only a model's first load in a dense format quantizes its dense layers; later loads read the
    same blocks back from MoEScope's cache folder. A damaged cache file converts again."""
    import torch

    from engine.model.dense_quantize import DenseCache, QuantizedLinear

    path = save_tiny_checkpoint("qwen2_moe", tmp_path / "model", seed=3, **WIDE["qwen2_moe"])
    before = tree_snapshot(path)
    settings = dict(budget="all", store="ram", dtype="bfloat16", expert_format="q4_k", dense_format="q6_k")

    def load() -> tuple[list[int], MoERuntime, list[str], dict[str, torch.Tensor]]:
        seen: list[str] = []
        tokens, runtime = greedy_reply(path, PROMPT, NEW_TOKENS, progress=lambda f, what: seen.append(what), **settings)
        blocks = {n: m.packed for n, m in runtime.model.named_modules() if isinstance(m, QuantizedLinear)}
        return tokens, runtime, seen, blocks

    tokens, runtime, seen, blocks = load()
    cached = DenseCache.of(runtime.fingerprint, runtime.files.files, runtime.dtype, FORMATS["q6_k"]).path
    assert any("converting dense weights to" in line for line in seen) and cached.is_file() and blocks
    assert not str(cached).startswith(str(path)) and tree_snapshot(path) == before
    size = cached.stat().st_size

    again, _, seen, reread = load()
    assert not any("converting dense" in line for line in seen)
    assert any("dense weights in" in line and "from the cache" in line for line in seen)
    assert again == tokens and reread.keys() == blocks.keys()
    assert all(torch.equal(reread[n], blocks[n]) for n in blocks)

    with open(cached, "r+b") as handle:  # a write cut short
        handle.truncate(size // 2)
    repaired, _, seen, _ = load()
    assert any("converting dense weights to" in line for line in seen)
    assert repaired == tokens and cached.stat().st_size == size


def test_the_demo_model_takes_llamacpps_fallback_for_its_narrow_matrices():
    # The demo's gate_up has 128 input features, not whole 256-element blocks: like llama-quantize,
    # 4-bit stores that matrix as Q5_0 (and says so), its down projection as Q4_K.
    tokens, runtime = generate("demo", budget="25%", store="disk", expert_format="4bit")
    from resources import DEMO_MODEL_DIR

    assert tokens == dequantized_reference(DEMO_MODEL_DIR, PROMPT, NEW_TOKENS, "q4_k")
    formats = {p.name: p.fmt.name for p in runtime.layout.params if p.fmt is not None}
    assert formats == {"gate_up_proj": "q5_0", "down_proj": "q4_k"}
    assert runtime.format_notes == ["expert weight 'gate_up_proj' has 128 input features, not whole 256-element "
                                    "blocks: stored as q5_0 instead of q4_k, as llama.cpp's quantizer does"]


def test_budget_planner_and_panels_count_the_formats_bytes(wide):
    path = wide["mixtral"]
    _, plain = generate(path, budget="all", store="ram")
    _, q4 = generate(path, budget="all", store="ram", expert_format="q4_k")
    expert_params = sum(p.shape[0] * p.shape[1] for p in plain.layout.params)
    assert plain.layout.slot_bytes >= expert_params * 4  # float32
    assert q4.layout.slot_bytes < expert_params * 4.5 / 8 + 256  # 4.5 bits a weight, aligned
    assert q4.layout.min_budget_bytes == q4.layout.slot_bytes * q4.layout.top_k * q4.layout.num_layers
    assert q4.cache.budget_bytes == q4.layout.all_expert_bytes
    # a byte budget buys more quantized experts
    _, plain_half = generate(path, budget=f"{plain.layout.all_expert_bytes // 4}B", store="disk")
    _, q4_half = generate(path, budget=f"{plain.layout.all_expert_bytes // 4}B", store="disk", expert_format="q4_k")
    assert sum(q4_half.cache.slots_per_layer) == q4.layout.num_layers * q4.layout.num_experts  # everything fits
    assert sum(plain_half.cache.slots_per_layer) < sum(q4_half.cache.slots_per_layer)


def test_the_conversion_runs_once_and_is_reused(wide):
    path = wide["olmoe"]
    seen: list[str] = []
    runtime = MoERuntime(LoadModel(path=str(path), expert_format="q3_k"), progress=lambda f, what: seen.append(what))
    runtime.close()
    assert any("converting experts to 3-bit (Q3_K)" in line for line in seen)
    folder = runtime.layout.pieces[0][0][0].file.parent
    assert folder.parent == quantized_store.quantized_root() and not str(folder).startswith(str(path))
    before = tree_snapshot(folder)
    seen.clear()
    MoERuntime(LoadModel(path=str(path), expert_format="q3_k"), progress=lambda f, what: seen.append(what)).close()
    assert not any("converting" in line for line in seen)
    assert tree_snapshot(folder) == before


def test_two_checkpoints_of_one_architecture_never_share_a_conversion(tmp_path):
    """A base model and its fine-tune have the same config and tensor shapes: each must run on its own
    converted experts, and a checkpoint rewritten in place must be converted again."""
    import os

    import torch
    from safetensors.torch import load_file

    first = save_tiny_checkpoint("olmoe", tmp_path / "base", seed=0, **WIDE["olmoe"])
    second = save_tiny_checkpoint("olmoe", tmp_path / "tuned", seed=1, **WIDE["olmoe"])
    folders, fingerprints = [], []
    for path in (first, second):
        runtime = MoERuntime(LoadModel(path=str(path), expert_format="q8_0"))
        fingerprints.append(runtime.fingerprint)
        runtime.close()
        folders.append(runtime.layout.pieces[0][0][0].file.parent)
    assert fingerprints[0] == fingerprints[1] and folders[0] != folders[1]  # one architecture, two conversions
    layer = "moe-layer-0000.safetensors"
    a, b = load_file(str(folders[0] / layer)), load_file(str(folders[1] / layer))
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)  # each model's own weights

    weights = next(second.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # saved again over the same folder
    seen: list[str] = []
    MoERuntime(LoadModel(path=str(second), expert_format="q8_0"), progress=lambda f, what: seen.append(what)).close()
    assert any("converting experts to 8-bit (Q8_0)" in line for line in seen)


def test_conversions_of_rewritten_or_deleted_checkpoints_are_removed(tmp_path):
    """A conversion whose checkpoint was rewritten or deleted can never be read again: the next
    conversion removes it (and says so), and leaves the conversions of untouched checkpoints."""
    import shutil

    from engine.model.dense_quantize import DenseCache

    paths = {name: save_tiny_checkpoint("mixtral", tmp_path / name, seed=seed, **WIDE["mixtral"])
             for seed, name in enumerate(("rewritten", "deleted", "kept"))}
    settings = dict(budget="all", store="ram", dtype="bfloat16", expert_format="q4_k", dense_format="q8_0")
    made = {}
    for name, path in paths.items():
        runtime = MoERuntime(LoadModel(path=str(path), **settings))
        runtime.close()
        made[name] = (runtime.layout.pieces[0][0][0].file.parent,
                      DenseCache.of(runtime.fingerprint, runtime.files.files, runtime.dtype, FORMATS["q8_0"]).path)
        assert all(p.exists() for p in made[name])
    save_tiny_checkpoint("mixtral", paths["rewritten"], seed=7, **WIDE["mixtral"])  # a new version, in place
    shutil.rmtree(paths["deleted"])
    seen: list[str] = []
    runtime = MoERuntime(LoadModel(path=str(paths["rewritten"]), **settings), progress=lambda f, what: seen.append(what))
    runtime.close()
    assert any("converting experts to" in line for line in seen)
    assert any(line.startswith("removed ") and "checkpoints changed or are gone" in line for line in seen)
    assert not any(p.exists() for p in made["rewritten"] + made["deleted"])
    assert all(p.exists() for p in made["kept"])
    assert runtime.layout.pieces[0][0][0].file.parent.is_dir()


def test_a_conversion_killed_midway_is_never_trusted(wide, tmp_path):
    # A process that dies after converting one layer leaves a .partial folder (6-bit: a format no other
    # test converts this model to, so the conversion really runs); the next load converts
    # again from the start and gives the right replies.
    path = wide["mixtral"]
    script = (
        "import os, sys\n"
        "from engine.decode.runtime import MoERuntime\n"
        "from engine.protocol import LoadModel\n"
        "def die(fraction, what):\n"
        "    if 'MoE layer 1 of' in what: os._exit(9)\n"
        f"MoERuntime(LoadModel(path={str(path)!r}, expert_format='q6_k'), progress=die)\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True, timeout=300)
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    partial = [p for p in quantized_store.quantized_root().iterdir() if p.name.endswith("-q6_k.partial")]
    assert partial and not any((p / quantized_store.MANIFEST).exists() for p in partial)
    seen: list[str] = []
    runtime = MoERuntime(LoadModel(path=str(path), expert_format="q6_k"), progress=lambda f, what: seen.append(what))
    runtime.close()
    assert any("converting" in line for line in seen)
    assert not any(p.name.endswith("-q6_k.partial") for p in quantized_store.quantized_root().iterdir())


def test_a_disk_too_small_is_refused_before_anything_is_written(wide, monkeypatch, capsys):
    import shutil

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(quantized_store.shutil, "disk_usage", lambda _path: usage._replace(free=1000))
    before = set(quantized_store.quantized_root().iterdir()) if quantized_store.quantized_root().exists() else set()
    # (3-bit: no other test converts this model to it, so a conversion would really start)
    assert moescope(["generate", "--model", str(wide["deepseek_v3"]), "--prompt-ids", "1,2,3", "--expert-format",
                     "3bit", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moescope: error: converting the experts to q3_k needs ") and "GiB is free" in err
    assert "\n" not in err
    after = set(quantized_store.quantized_root().iterdir()) if quantized_store.quantized_root().exists() else set()
    assert after == before


def test_a_format_the_experts_cannot_take_is_refused_naming_the_tensor(tmp_path, capsys):
    path = save_tiny_checkpoint("mixtral", tmp_path / "odd", hidden_size=48, num_attention_heads=4)
    assert moescope(["info", "--model", str(path), "--expert-format", "q8_0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("moescope: error: expert weight 'gate_up_proj' has 48 input features, not a whole number of "
                   "32-element blocks, so it cannot be stored as q8_0; formats that fit: none of the block formats "
                   "(or original)")
    import torch

    from engine.model.layout import quantized_params
    from engine.model.loader import build_model

    layout = build_model(path, device=torch.device("meta"), load_dense=False).layout
    down = [p for p in layout.params if p.name == "down_proj"]
    with pytest.raises(CheckpointError, match="'down_proj' has 48 input features"):
        quantized_params(down, FORMATS["q4_k"])


def test_info_reports_the_formats_bytes(wide, capsys):
    assert moescope(["info", "--model", str(wide["qwen2_moe"]), "--expert-format", "q4_k", "--json"]) == 0
    q4 = json.loads(capsys.readouterr().out)
    assert moescope(["info", "--model", str(wide["qwen2_moe"]), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert q4["expert_format"] == "q4_k" and plain["expert_format"] == "original"
    assert q4["expert_bytes"] * 7 < plain["expert_bytes"]  # float32 -> 4.5 bits
    assert q4["min_budget_bytes"] == q4["expert_bytes"] * q4["top_k"] * q4["num_moe_layers"]


def test_expanding_slots_natively_changes_no_bit_of_the_exact_path(wide, kernels):
    """Prefill and the exact path read quantized experts and dense layers expanded to bf16; once
    the native kernels are built they expand them (far faster than the torch reference), and the
    logits stay bit-identical to the reference expansion's."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.base import Step
    from engine.decode.paths.transformers_path import model_forward
    from engine.formats.dequantize import reference_dequantizer
    from engine.model.dense_quantize import QuantizedLinear

    runtime = MoERuntime(LoadModel(path=str(wide["qwen2_moe"]), budget="30%", store="ram", device="cpu",
                                   dtype="bfloat16", expert_format="q4_k", dense_format="q6_k"))
    prompt = torch.tensor([PROMPT])
    try:
        with torch.inference_mode():
            native = model_forward(runtime.model, Step(prompt, new_cache(runtime.model), 0))
            runtime.cache.use_dequantizer(reference_dequantizer)
            dense = [m for m in runtime.model.modules() if isinstance(m, QuantizedLinear)]
            for module in dense:
                module.dequantizer = reference_dequantizer
            reference = model_forward(runtime.model, Step(prompt, new_cache(runtime.model), 0))
    finally:
        runtime.close()
    assert dense and torch.equal(native, reference)


def prompt_logits_fast_and_exact(load: LoadModel, kernels, monkeypatch, native: bool) -> dict:
    """The prompt's last logits with fast decode on (True) and off (False), checking the path each
    took: with fast decode on, the native prompt path and its one layer call where `native`,
    transformers' kernels otherwise (and always with it off)."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.base import Step
    from engine.decode.paths.native_layers import NativePromptPath
    from engine.decode.paths.whole_token import WholeTokenPath

    calls = []
    moe_prompt = kernels.moe_prompt
    monkeypatch.setattr(kernels, "moe_prompt", lambda *args: calls.append(1) or moe_prompt(*args))
    runtime = MoERuntime(load)
    prompt = torch.tensor([PROMPT])
    logits = {}
    try:
        with torch.inference_mode():
            for fast in (True, False):
                runtime.set_fast_decode(fast)
                step = Step(prompt, new_cache(runtime.model), 0)
                # the paths in the chooser's order but the whole-token step, which at `all` takes a
                # prompt this short as its rows (tests/test_whole_token_prompt.py)
                path = next(p for p in runtime.paths.paths
                            if not isinstance(p, WholeTokenPath) and p.unavailable(step) is None)
                assert isinstance(path, NativePromptPath) == (fast and native), path.label
                assert "lossy" not in path.label
                calls.clear()
                logits[fast] = path.run(step)
                assert bool(calls) == (fast and native)  # the exact path expands the slots for transformers' kernels
    finally:
        runtime.close()
    return logits


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_a_prompt_multiplies_quantized_experts_in_their_blocks(wide, kernels, monkeypatch, family):
    """With fast decode, a prompt's quantized experts of a layer are multiplied tile by tile in one
    native call (never expanded whole into a scratch), its linears on `linear_rows`: the logits
    equal the exact path's to bf16 summation order."""
    from dataclasses import replace

    from tests.helpers.numerics import close

    load = LoadModel(path=str(wide[family]), budget="all", store="ram", device="cpu", dtype="bfloat16",
                     expert_format="q4_k", fast_decode=True)
    with forced_paths(kernels, integer_dots=False):  # every expert on tiles, expanded to the exact path's bf16
        tiles = prompt_logits_fast_and_exact(load, kernels, monkeypatch, native=True)
    # Every linear and expert of the prompt sums in another order, and through the layers of a random
    # model one-step differences compound: to about 3 % on Qwen2-MoE, whose shared experts add linears,
    # where the CPU has bf16 dot products. Where it has none (AVX2), oneDNN's bf16 products round
    # otherwise, and on Mixtral both paths land 20-30 % from the float32 model's logits, 10 % apart:
    # the tiles are then held to be no further from the float32 model than the exact path is.
    truth = prompt_logits_fast_and_exact(replace(load, dtype="float32", fast_decode=False), kernels, monkeypatch,
                                         native=False)[False].float()
    scale = truth.abs().max()
    if (tiles[True].float() - tiles[False].float()).abs().max() > 0.04 * scale:
        assert (tiles[True].float() - truth).abs().max() <= (tiles[False].float() - truth).abs().max() + 0.02 * scale
    assert tiles[True].argmax() == tiles[False].argmax()
    # By default an 8-token prompt's experts have few rows each and take the decode step's integer
    # dots, whose reference is the float32 dequantized weights (not rounded to bf16 first, as the exact
    # path's are): a little further from the exact path through a random model's layers (measured:
    # 8 % on Mixtral, 4 % on Qwen2-MoE), each layer as close to float32 as the tiles
    # (tests/test_quant_kernels.py); the top token the same.
    logits = prompt_logits_fast_and_exact(load, kernels, monkeypatch, native=True)
    close(logits[True], logits[False], family, relative=0.12)
    assert logits[True].argmax() == logits[False].argmax()


def test_a_fast_prompt_never_expands_a_quantized_dense_matrix(wide, kernels):
    """With fast decode and dense weights in a block format, a prompt's linears multiply the blocks
    (`linear_rows`), and the one row its last position sends through the LM head takes the GEMV:
    no dense matrix is expanded to bf16 (the exact path does, for transformers' products)."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.base import Step
    from engine.model.dense_quantize import QuantizedLinear

    runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", device="cpu",
                                   dtype="bfloat16", expert_format="q4_k", dense_format="q8_0", fast_decode=True))
    expanded = []
    try:
        dense = [m for m in runtime.model.modules() if isinstance(m, QuantizedLinear)]
        assert any(m is runtime.model.get_output_embeddings() for m in dense)
        for module in dense:
            def counting(packed, fmt, columns, out, module=module, expand=module.dequantizer):
                expanded.append(module)
                return expand(packed, fmt, columns, out)
            module.dequantizer = counting
        logits = {}
        with torch.inference_mode():
            for fast in (True, False):
                runtime.set_fast_decode(fast)
                expanded.clear()
                step = Step(torch.tensor([PROMPT]), new_cache(runtime.model), 0)
                logits[fast] = runtime.paths.choose(step)[0].run(step)
                assert bool(expanded) == (not fast), fast
    finally:
        runtime.close()
    assert logits[True].argmax() == logits[False].argmax()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fast_decode_gives_the_same_logits_at_every_budget(wide, kernels, family):
    """A decode token whose experts must first be loaded waits for them and then runs on the very
    kernel of a token whose experts were all resident: fed the same tokens one at a time, the
    smallest budget on the disk store and the whole model in RAM give bit-identical logits."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.base import Step

    logits, misses = {}, {}
    for budget, store in (("1", "disk"), ("all", "ram")):
        runtime = MoERuntime(LoadModel(path=str(wide[family]), budget=budget, store=store, device="cpu",
                                       dtype="bfloat16", expert_format="q4_k", fast_decode=True))
        try:
            cache, steps = new_cache(runtime.model), []
            with torch.inference_mode():
                for position, token in enumerate(PROMPT + PROMPT[::-1]):
                    step = Step(torch.tensor([[token]]), cache, position)
                    path, why_not = runtime.paths.choose(step)
                    if position == 0:  # a one-token prompt: at `all` the step's rows, else the prompt path
                        path = next(p for p in runtime.paths.paths if "prompt" in p.label and not p.unavailable(step))
                    assert "native" in path.label, (path.label, why_not)
                    steps.append(path.run(step)[0, -1])
                    cache = step.kv
            logits[budget], misses[budget] = torch.stack(steps), int(runtime.counters.request_layer_misses.sum())
        finally:
            runtime.close()
    assert misses["1"] > len(PROMPT)  # the small budget really loaded experts on the way
    assert torch.equal(logits["1"], logits["all"])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_bf16_prompt_takes_the_native_rows_where_torch_bf16_matmuls_are_slow(wide, kernels, monkeypatch, family):
    """On a CPU whose torch bf16 matmul has no oneDNN kernel (AVX2 without AVX-512, where it runs several
    times slower than float32), a bf16 model's prompt takes the native rows and layer call too, in
    float32 tiles, and on one with bf16 dot products the native rows take it on those, or on AMX tiles
    beside them; where oneDNN's bf16 kernels are the faster (AMX tiles the rows cannot use, or no bf16
    dot products in the build), transformers' kernels do. Either way the logits equal the exact path's
    to summation order."""
    import torch

    from engine.decode.native import kernels as native
    from tests.helpers.numerics import close

    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    native_rows = (kernels.bf16_dot_products() or not onednn_bf16) and (not native.amx_tiles() or kernels.amx())
    assert native.bf16_prompt_beats_torch(kernels) == native_rows
    logits = prompt_logits_fast_and_exact(
        LoadModel(path=str(wide[family]), budget="all", store="ram", device="cpu", dtype="bfloat16",
                  fast_decode=True), kernels, monkeypatch, native=native_rows)
    # AMX tiles sum in another order than oneDNN's: 4.8 % of the scale on mixtral, where each of the
    # two bf16 forwards is about 16 % from the float32 one (the tiles' the closer)
    close(logits[True], logits[False], family, relative=0.06)
    assert logits[True].argmax() == logits[False].argmax()


def test_prompts_of_new_lengths_make_no_onednn_kernels_on_the_fast_path(wide, kernels, capfd):
    """oneDNN makes, and keeps, a kernel (about half a MiB) for every new row count a matmul sees, so
    a chat whose prompts vary in length grew the process by a few MiB each time. A fast prompt's
    linears and routers run on the native kernels: prompts of new lengths make no oneDNN kernel,
    where the exact path (transformers' kernels) makes some for each."""
    import torch

    from engine.decode.generation import Generator
    from engine.protocol import SamplingSettings

    runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", device="cpu",
                                   dtype="bfloat16", expert_format="q4_k", fast_decode=True))
    made = {}
    try:
        generator = Generator(runtime)
        for fast, lengths in ((True, (7, 13, 19)), (False, (9, 15, 21))):
            runtime.set_fast_decode(fast)
            capfd.readouterr()
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
                for n in lengths:
                    generator.generate([(7 * i + n) % 90 + 3 for i in range(n)],
                                       SamplingSettings(temperature=0, max_new_tokens=2))
            made[fast] = [line for line in capfd.readouterr().out.splitlines() if "create:cache_miss" in line]
    finally:
        runtime.close()
    if not made[False]:
        pytest.skip("oneDNN makes no kernels for these bf16 matmuls on this CPU (no AVX-512): nothing to count")
    assert made[True] == []


@pytest.mark.parametrize("dense", ["original", "q4_k"])
def test_8_bit_prompt_inputs_are_opt_in_labelled_and_close(wide, kernels, monkeypatch, dense):
    """--int8-inputs (lossy, off by default): a prompt's Q4_K experts and dense linears take their
    inputs rounded to 8 bits. It changes the arithmetic (the logits are not the bf16 path's), the path
    says it is lossy, teacher-forced scoring (`prompt_logits`, what bench.lossy_cost measures) goes
    through it, and the logits stay close enough that the next token is the same. (Beside AMX tiles the
    path sets the 8-bit inputs aside, next test; here the tiles are off so that they apply.)"""
    import torch

    from engine.decode.paths.base import Step

    asked, asked_dense = [], []
    moe_prompt, linear_rows = kernels.moe_prompt, kernels.linear_rows
    monkeypatch.setattr(kernels, "moe_prompt", lambda *args: asked.append(args[-1]) or moe_prompt(*args))
    monkeypatch.setattr(kernels, "linear_rows", lambda *args: asked_dense.append(args[3:]) or linear_rows(*args))
    logits, labels = {}, {}
    # integer dots off: the 8-bit inputs set against the bf16 tiles they replace (by default few-row
    # experts take the integer dots, which the 8-bit inputs never do)
    with forced_paths(kernels, amx=False, integer_dots=False):
        runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", device="cpu",
                                       dtype="bfloat16", expert_format="q4_k", dense_format=dense))
        assert runtime.int8_inputs is False  # opt-in only
        try:
            for int8 in (False, True):
                runtime.int8_inputs = int8  # the System panel's switch is live
                labels[int8] = runtime.paths.choose(Step(torch.tensor([PROMPT]), None, 0))[0].label
                asked.clear()
                asked_dense.clear()
                logits[int8] = runtime.prompt_logits(PROMPT)
                assert asked and set(asked) == {int8}
                rounded = {a[0] for a in asked_dense if a}  # per dense linear's call (the routers' leave it out)
                assert rounded == ({int8} if dense == "q4_k" else {False})
        finally:
            runtime.close()
    assert "lossy" not in labels[False] and "8-bit inputs" in labels[True] and "(lossy)" in labels[True]
    assert "AMX" not in labels[False] + labels[True]
    assert logits[True].shape == (len(PROMPT), runtime.model.config.vocab_size)
    assert not torch.equal(logits[True], logits[False])
    ours, bf16 = logits[True].float().flatten(), logits[False].float().flatten()
    # a tiny random model amplifies any rounding; the demo model's answers are measured in bench.lossy_cost
    cosine = torch.nn.functional.cosine_similarity(ours, bf16, dim=0)
    same_top = logits[True].argmax(-1) == logits[False].argmax(-1)
    assert cosine > 0.95
    # Every position's top token stays among the bf16 path's top 8 (of 128), and with bf16 attention most
    # keep theirs (7 of 8). This tiny random model's logits hold near ties (a margin of 0 at one position on
    # an AVX-512 machine), so which of them win moves with the CPU's bf16 arithmetic: with the attention's
    # inputs rounded too, 4 of 8 keep theirs on AVX2 and on AVX-512 alike, but not the same 4, and the
    # others rank at most 4th on a Zen 4 core (AVX-512), 6th on a Zen 3 core (AVX2).
    ranks = (logits[False] > logits[False].gather(-1, logits[True].argmax(-1, keepdim=True))).sum(-1)
    assert ranks.max() < 8, ranks
    assert dense != "original" or same_top.float().mean() >= 0.75


def test_8_bit_prompt_inputs_are_set_aside_beside_amx_tiles(wide, kernels, monkeypatch):
    """Beside AMX tiles a Q4_K prompt's bf16 products on the tiles are faster than the 8-bit dots, so
    --int8-inputs buys only its loss there: the path sets it aside (the exact-precision inputs go to
    the kernels) and its label says so; the tiles are named where they run."""
    import torch

    from engine.decode.paths.base import Step

    if not kernels.amx():
        pytest.skip("no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
    asked = []
    moe_prompt = kernels.moe_prompt
    monkeypatch.setattr(kernels, "moe_prompt", lambda *args: asked.append(args[-1]) or moe_prompt(*args))
    runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", device="cpu",
                                   dtype="bfloat16", expert_format="q4_k", int8_inputs=True))
    try:
        label = runtime.paths.choose(Step(torch.tensor([PROMPT]), None, 0))[0].label
        asked_logits = runtime.prompt_logits(PROMPT)
        runtime.int8_inputs = False
        plain_label = runtime.paths.choose(Step(torch.tensor([PROMPT]), None, 0))[0].label
        plain_logits = runtime.prompt_logits(PROMPT)
    finally:
        runtime.close()
    assert asked and set(asked) == {False}
    assert "not used" in label and "lossy" not in label and "(AMX tiles)" in label
    assert "(AMX tiles)" in plain_label and "not used" not in plain_label
    assert torch.equal(asked_logits, plain_logits)


@pytest.mark.parametrize("path", ["whole_token", "native_layers"])
def test_8_bit_inputs_reach_decode_opt_in_and_labelled(wide, kernels, path):
    """--int8-inputs (lossy, off by default) rounds a decode token's inputs to its K-quant matrices
    too, on the whole-token step and on the per-layer path alike: the token's logits are not the
    16-bit inputs' (and stay close), the path that ran says it is lossy, and the switch is live."""
    import torch

    from engine.decode.paths.base import Step
    from tests.test_whole_token import prefilled

    runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", device="cpu",
                                   dtype="bfloat16", expert_format="q4_k", dense_format="q4_k"))
    assert runtime.int8_inputs is False  # opt-in only
    decode = getattr(runtime, path)
    logits, labels = {}, {}
    try:
        for int8 in (False, True):
            runtime.int8_inputs = int8  # the System panel's switch is live
            kv = prefilled(runtime, PROMPT)
            step = Step(torch.tensor([[PROMPT[-1]]]), kv, kv.get_seq_length(), token=PROMPT[-1])
            assert decode.unavailable(step) is None
            with torch.inference_mode():
                logits[int8] = decode.run(step)[0, -1].float()
            labels[int8] = decode.label
    finally:
        runtime.close()
    assert "lossy" not in labels[False] and "8-bit inputs" in labels[True] and "(lossy)" in labels[True]
    assert not torch.equal(logits[True], logits[False])
    assert torch.nn.functional.cosine_similarity(logits[True], logits[False], dim=0) > 0.95
