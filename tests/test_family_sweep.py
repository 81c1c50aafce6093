"""The family sweep: every decorated MoE family in transformers runs offloaded with stock output.

CI runs the families that showed each failure class the loader had (one per class) plus a part of
the rest that rotates by day; `-m slow` runs all of them, as `python -m bench.family_sweep` does.
"""

from __future__ import annotations

import datetime
import json
import sys

import pytest

from bench.family_checkpoints import families, save_family_checkpoint
from bench.family_sweep import sweep_family
from engine.cli.main import main as moescope
from engine.protocol import TEXT_ONLY_NOTE

ALL = {family.name: family for family in families()}

# The family that showed each failure class, and the class (issue 24).
FAILURE_CLASSES = {
    "aria": "top-k only on the router (config key moe_topk)",
    "gemma4": "top-k only on the router's config (top_k_experts); MoE blocks beside a dense MLP",
    "deepseek_v4": "a renaming rule that also hits the final norm: transformers keeps the original key",
    "mistral4": "the causal-LM class is missing from the auto mapping; config.json's architectures names it",
    "minimax": "a cache class of its own (lightning-attention state)",
    "qwen3_vl_moe": "multimodal: text through the conditional-generation class; fused experts stored transposed",
    "dots3_note": "a vision tower with experts of another shape: they stay in memory, on transformers' forward",
    "ernie4_5_vl_moe": "one checkpoint list of experts split into text and (narrower, in-memory) vision experts",
    "inkling2_loop": "an expert converter that dequantizes on load: unquantized experts pass through it",
    "qwen3_omni_moe": "a class without a forward: its thinker writes the text, given positions as generate does",
    "diffusion_gemma": "block diffusion: the model's own generate, an encoder whose experts are tied to the decoder's",
}
# Families that cannot run exactly yet, and why: the sweep lists them with that reason.
KNOWN_FAILURES = {
    "openai_privacy_filter": "a token classifier: transformers has no class that generates text for it",
}  # (an older transformers may lack some of these families)
ROTATING_PER_RUN = 2
CI_RUNS = (("30%", "disk"), ("all", "ram"))  # the slow sweep runs both budgets on both stores


def rotating(day: int | None = None) -> list[str]:
    """A different part of the families without a failure class of their own each day."""
    rest = sorted(set(ALL) - set(FAILURE_CLASSES) - set(KNOWN_FAILURES))
    day = datetime.date.today().toordinal() if day is None else day
    start = day * ROTATING_PER_RUN % len(rest)
    return [rest[(start + i) % len(rest)] for i in range(ROTATING_PER_RUN)]


def assert_exact(result) -> None:
    assert result.built, result.failure
    assert result.exact, f"{result.family}: {result.runs} {result.failure}"


def test_every_decorated_family_is_found():
    # Found by introspection, so a new transformers release's family shows up here by itself.
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe", *FAILURE_CLASSES} <= set(ALL)
    assert len(ALL) >= 60


def test_rotation_covers_every_family_over_the_days():
    seen = {name for day in range(len(ALL)) for name in rotating(day)}
    assert seen == set(ALL) - set(FAILURE_CLASSES) - set(KNOWN_FAILURES)


@pytest.mark.parametrize("family", list(FAILURE_CLASSES))
def test_failure_class_is_fixed(tmp_path, family):
    assert_exact(sweep_family(ALL[family], tmp_path, runs=CI_RUNS, decode_path=False))


@pytest.mark.parametrize("family", rotating())
def test_rotating_family_is_exact(tmp_path, family):
    assert_exact(sweep_family(ALL[family], tmp_path, runs=CI_RUNS, decode_path=False))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(ALL))
def test_whole_sweep(tmp_path, family):
    result = sweep_family(ALL[family], tmp_path, decode_path=False)
    if family in KNOWN_FAILURES:
        assert not result.exact, f"{family} runs exactly now: take it off KNOWN_FAILURES"
        assert result.failure
        return
    assert_exact(result)


def test_top_k_comes_from_the_router_not_the_config(tmp_path):
    # Gemma-4's config says top_k_experts, a key the config fallback list does not know.
    from engine.errors import CheckpointError
    from engine.model.inspect import inspect_checkpoint
    from engine.model.layout import find_top_k

    path = save_family_checkpoint(ALL["gemma4"], tmp_path / "gemma4").path
    info = inspect_checkpoint(path)
    assert info.top_k == 2
    from transformers import AutoConfig

    with pytest.raises(CheckpointError):
        find_top_k(AutoConfig.from_pretrained(path))


def test_multimodal_model_says_text_only(tmp_path, capsys):
    path = save_family_checkpoint(ALL["qwen3_vl_moe"], tmp_path / "qwen3_vl_moe").path
    assert moescope(["info", "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text_only"] is True
    assert moescope(["info", "--model", str(path)]) == 0
    assert TEXT_ONLY_NOTE in capsys.readouterr().out


def test_names_that_match_no_weight_are_not_blamed_on_the_download(tmp_path, capsys, mixtral_checkpoint):
    # A checkpoint whose final norm is saved under a name the model does not have: the message says
    # the names do not match, not that the download is incomplete.
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "renamed"
    shutil.copytree(mixtral_checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.final_layernorm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    code = moescope(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code != 0
    assert "model.norm.weight" in err and "model.final_layernorm.weight" in err
    assert "do not match" in err and "incomplete" not in err


def test_a_package_the_models_code_needs_is_named(tmp_path, capsys, monkeypatch):
    # Inkling's vision tower imports scipy, which transformers does not require: a machine without it
    # gets one line naming the package, and the chat runs once it is installed.
    path = save_family_checkpoint(ALL["inkling"], tmp_path / "inkling").path
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # as if scipy were not installed
    assert moescope(["info", "--model", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "needs the Python package 'scipy'" in err and "pip install scipy" in err and "\n" not in err
    monkeypatch.delitem(sys.modules, "scipy.optimize")
    assert moescope(["info", "--model", str(path)]) == 0


def test_a_towers_experts_of_another_shape_stay_in_memory(tmp_path):
    # Dots3's vision tower has experts of its own shape: the cache takes the text stack's experts, and the
    # tower's are loaded with the dense weights (counted there), so text chat runs and the budget is honest.
    import torch

    from engine.model.layout import is_experts_module
    from engine.model.loader import build_model

    path = save_family_checkpoint(ALL["dots3_note"], tmp_path / "dots3_note").path
    loaded = build_model(path, device=torch.device("cpu"))
    offloaded = set(loaded.layout.module_paths)
    experts = [name for name, m in loaded.model.named_modules() if is_experts_module(m)]
    towers = [name for name in experts if name not in offloaded]
    assert towers and all("vision" in name for name in towers)
    assert {name for name in experts if "language_model" in name} <= offloaded
    resident = [p for name in towers for p in loaded.model.get_submodule(name).parameters(recurse=False)]
    assert resident and all(p.device.type == "cpu" for p in resident)  # real weights, not the store's placeholders


def test_a_list_of_experts_split_between_text_and_vision_modules(tmp_path):
    # ERNIE-4.5-VL stores text experts 0..E-1 and vision experts E..2E-1 in one list that transformers'
    # converter splits between two modules: the text ones go to the store, the narrower vision ones stay
    # in memory with the weights stock loading gives them.
    import torch

    from engine.model.loader import build_model

    family = ALL["ernie4_5_vl_moe"]
    path = save_family_checkpoint(family, tmp_path / family.name).path
    loaded = build_model(path, device=torch.device("cpu"))
    assert loaded.layout.module_paths and all("text_moe" in name for name in loaded.layout.module_paths)
    stock = family.model_class.from_pretrained(path, dtype=torch.float32)
    vision = {name: p for name, p in stock.named_parameters() if "vision_moe.experts" in name}
    assert vision
    ours = dict(loaded.model.named_parameters())
    for name, weight in vision.items():
        assert torch.equal(ours[name], weight), name


def test_experts_a_converter_would_dequantize_are_refused_in_one_line(tmp_path):
    # Inkling2Loop's converter dequantizes NVFP4/MXFP8 experts on load and passes unquantized ones through:
    # the latter run (the sweep), a checkpoint with the quantized experts' scales is refused, naming why.
    import torch
    from safetensors.torch import load_file, save_file

    from engine.errors import CheckpointError
    from engine.model.loader import build_model

    path = save_family_checkpoint(ALL["inkling2_loop"], tmp_path / "inkling2_loop").path
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(shard)
    weight = next(name for name in tensors if name.endswith("mlp.experts.w13_weight"))
    tensors[weight + "_scale"] = torch.full((*tensors[weight].shape[:2], 1), 127, dtype=torch.uint8)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="dequantizes on load") as refused:
        build_model(path, device=torch.device("cpu"))
    assert "\n" not in str(refused.value) and "_scale" in str(refused.value)


def test_a_block_diffusion_model_streams_blocks_through_the_cache(tmp_path):
    # DiffusionGemma denoises a block of tokens at a time in its own generate; its encoder runs the
    # decoder's layers (tied weights), so both reach the same offloaded experts. The reply equals stock
    # transformers' from the same seed, it stops where asked inside a block, and the cache saw traffic.
    import torch

    from bench.family_sweep import PROMPT, reference_tokens
    from engine.decode.block_diffusion import LABEL, SAMPLING_NOTE
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.errors import MoEScopeError
    from engine.protocol import LoadModel, SamplingSettings

    if "diffusion_gemma" not in ALL:
        pytest.skip("this transformers release has no DiffusionGemma")
    family = ALL["diffusion_gemma"]
    path = save_family_checkpoint(family, tmp_path / "diffusion_gemma").path
    runtime = MoERuntime(LoadModel(path=str(path), budget="30%", store="disk", dtype="float32", fast_decode=False))
    try:
        assert runtime.layout.twins and len(runtime.layout.twins) == runtime.layout.num_layers
        streamed: list[int] = []
        drafts: list[str] = []
        cancel_after = 5
        state = torch.random.get_rng_state()
        result = Generator(runtime).generate(
            PROMPT, SamplingSettings(temperature=0, max_new_tokens=64), on_token=streamed.append,
            between_tokens=lambda: len(streamed) >= cancel_after, on_draft=drafts.append)
        # a draft after each denoising step; the last one is the block that then came token by token
        assert drafts and drafts[-1].startswith(result.text) and len(drafts[-1]) > len(result.text)
        assert torch.equal(torch.random.get_rng_state(), state)  # the canvases' seed leaves the caller's RNG alone
        assert result.finish_reason == "cancelled" and len(result.token_ids) == cancel_after
        assert result.token_ids == reference_tokens(family, path)[:cancel_after]
        assert result.stats.misses > 0 and runtime.decode_path == LABEL
        # a block's tokens come together: the rate counts them over the whole reply, not after the first
        assert result.stats.decode_tokens_per_s == pytest.approx(cancel_after / result.stats.total_s)
        assert SAMPLING_NOTE in runtime.load_notes()  # the window and the CLI say which settings apply
        with pytest.raises(MoEScopeError, match="token by token"):
            runtime.prompt_logits(PROMPT)
    finally:
        runtime.close()
