"""Bad input: one clear line on stderr, a non-zero exit, and nothing written to the user's files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.cli.main import main as moescope
from tests.helpers.checkpoints import save_tiny_checkpoint, set_config_field, tree_snapshot


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop whatever the fixtures printed
    code = moescope(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def generate_args(path, *extra: str) -> list[str]:
    return ["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json", *extra]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moescope: error:"), err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def copy_of(tmp_path, mixtral_checkpoint):
    def make(name: str):
        target = tmp_path / name
        shutil.copytree(mixtral_checkpoint, target)
        return target

    return make


def test_missing_path(capsys, tmp_path):
    code, _, err = run(capsys, *generate_args(tmp_path / "nowhere"))
    assert_one_line_error(code, err, "does not exist")


def test_dense_model_is_named_as_not_moe(capsys, tmp_path):
    path = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)).save_pretrained(path)
    before = tree_snapshot(path)
    code, _, err = run(capsys, *generate_args(path))
    assert_one_line_error(code, err, "dense model", "not a mixture-of-experts")
    assert tree_snapshot(path) == before


def test_a_transformers_too_old_for_the_engine_is_named_not_every_model_called_dense():
    from engine.errors import MoEScopeError
    from engine.model.experts_registry import check_transformers

    with pytest.raises(MoEScopeError, match=r"transformers 5\.17\.0 is older than the 5\.24 .*pip install"):
        check_transformers("5.17.0")
    check_transformers()  # the installed one (pyproject.toml requires the same minimum)


def test_pickle_only_is_refused_unless_allowed(capsys, tmp_path, mixtral_checkpoint):
    path = tmp_path / "pickled"
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mixtral_checkpoint / name, path / name)
    from safetensors.torch import load_file

    torch.save(load_file(mixtral_checkpoint / "model.safetensors"), path / "pytorch_model.bin")
    before = tree_snapshot(path)
    code, _, err = run(capsys, *generate_args(path))
    assert_one_line_error(code, err, "pickle", "--allow-pickle")
    assert tree_snapshot(path) == before

    ok = run(capsys, *generate_args(path, "--allow-pickle"))
    reference = run(capsys, *generate_args(mixtral_checkpoint))
    assert ok[0] == 0
    assert json.loads(ok[1])["token_ids"] == json.loads(reference[1])["token_ids"]  # the converted copy is the model
    assert tree_snapshot(path) == before  # the conversion went to MoEScope's cache, not the user's folder


def test_remote_code_is_refused_by_default(capsys, copy_of):
    path = copy_of("remote")
    set_config_field(path, model_type="evil_moe", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    before = tree_snapshot(path)
    code, _, err = run(capsys, *generate_args(path))
    assert_one_line_error(code, err, "--trust-remote-code")
    assert tree_snapshot(path) == before


def test_remote_code_is_not_needed_for_architectures_transformers_ships(capsys, copy_of, mixtral_checkpoint):
    # Many Hub repos keep auto_map from before transformers had the architecture built in.
    path = copy_of("builtin-with-auto-map")
    set_config_field(path, auto_map={"AutoModelForCausalLM": "modeling_mixtral.MixtralForCausalLM"})
    code, out, _ = run(capsys, *generate_args(path))
    assert code == 0
    assert json.loads(out)["token_ids"] == json.loads(run(capsys, *generate_args(mixtral_checkpoint))[1])["token_ids"]


def test_truncated_safetensors_names_the_file(capsys, copy_of):
    path = copy_of("truncated")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    before = tree_snapshot(path)
    code, _, err = run(capsys, *generate_args(path))
    assert_one_line_error(code, err, "model.safetensors", "truncated")
    assert tree_snapshot(path) == before


def test_corrupt_header_names_the_file(capsys, copy_of):
    path = copy_of("corrupt")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32
    weights.write_bytes(bytes(data))
    code, _, err = run(capsys, *generate_args(path))
    assert_one_line_error(code, err, "model.safetensors", "corrupt")


def test_budget_below_minimum_is_clamped_and_said(capsys, mixtral_checkpoint):
    code, out, err = run(capsys, *generate_args(mixtral_checkpoint, "--budget", "1KiB"))
    assert code == 0
    assert "below this model's minimum" in err and "using the minimum" in err
    assert out.strip().startswith("{")


def test_prompt_longer_than_context(capsys, tmp_path):
    path = save_tiny_checkpoint("mixtral", tmp_path / "short", max_position_embeddings=16)
    ids = ",".join(["5"] * 20)
    code, _, err = run(capsys, "generate", "--model", str(path), "--prompt-ids", ids, "--json")
    assert_one_line_error(code, err, "20 tokens", "context is 16")


def test_bad_budget_text(capsys, mixtral_checkpoint):
    code, _, err = run(capsys, *generate_args(mixtral_checkpoint, "--budget", "lots"))
    assert_one_line_error(code, err, "lots")


def test_installed_entry_point_reports_errors(tmp_path):
    """The real `moescope` executable, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "--model", str(tmp_path / "x"),
                           "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("moescope: error:") and "does not exist" in proc.stderr
