"""Models already on this machine: a hand-made HF cache is listed, opened and run; removal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.errors import CheckpointError
from engine.hub.errors import HubError
from engine.hub.estimate import estimate_folder
from engine.hub.local import find_cached, list_cached_models, remove_cached, resolve_model
from engine.hub.paths import repo_folder
from tests.helpers.checkpoints import reference_generate
from tests.helpers.hub.library_hub import SHA, place_in_cache

PROMPT = [1, 17, 42, 9, 77, 5]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(path))  # as a user (or another tool) configured it
    return path


def test_a_model_in_the_hf_cache_is_listed_and_runs(cache, mixtral_checkpoint):
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    snapshot = place_in_cache(cache, "someone/tiny-mixtral", mixtral_checkpoint)
    [model] = list_cached_models()  # HF_HUB_CACHE decides where to look
    assert (model.repo_id, model.snapshot, model.commit, model.refs) == ("someone/tiny-mixtral", snapshot, SHA, ["main"])
    assert model.runnable and model.complete
    assert model.size_on_disk == sum(f.stat().st_size for f in mixtral_checkpoint.iterdir())

    path = resolve_model("someone/tiny-mixtral")
    assert path == snapshot
    runtime = MoERuntime(LoadModel(path=str(path), budget="1", store="disk", device="cpu"))
    try:
        assert "below this model's minimum" in runtime.plan.note  # the smallest budget there is
        result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=6))
    finally:
        runtime.close()
    assert result.token_ids == reference_generate(mixtral_checkpoint, PROMPT, 6)
    assert estimate_folder(snapshot).download_bytes == (mixtral_checkpoint / "model.safetensors").stat().st_size


def test_what_the_engine_cannot_run_is_listed_only_on_request(cache, mixtral_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(mixtral_checkpoint).save_pretrained(sharded, max_shard_size="200KB")
    last_shard = sorted(sharded.glob("model-*.safetensors"))[-1].name
    place_in_cache(cache, "someone/half-downloaded", sharded, skip=(last_shard,))

    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    place_in_cache(cache, "someone/dense-llama", dense)

    quantized = tmp_path / "quantized"
    shutil.copytree(mixtral_checkpoint, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    place_in_cache(cache, "someone/awq-mixtral", quantized)

    assert list_cached_models() == []
    problems = {m.repo_id: m.problem for m in list_cached_models(include_all=True)}
    assert problems == {
        "someone/dense-llama": "model type 'llama' is not a mixture-of-experts family MoEScope runs",
        "someone/awq-mixtral": "awq quantized weights are not supported by MoEScope (it runs mxfp4 and block-wise fp8)",
        "someone/half-downloaded": "download incomplete: run `moescope models download` again",
    }
    with pytest.raises(CheckpointError, match="'someone/half-downloaded' is not downloaded yet; get it with "
                                              "`moescope models download someone/half-downloaded`"):
        resolve_model("someone/half-downloaded")


def test_resolve_model_messages(cache, mixtral_checkpoint):
    assert resolve_model(str(mixtral_checkpoint)) == mixtral_checkpoint  # plain folders open as they are
    with pytest.raises(CheckpointError, match="'org/absent' is not downloaded yet"):
        resolve_model("org/absent")
    with pytest.raises(CheckpointError, match="model path 'no/such/folder' does not exist"):
        resolve_model("no/such/folder")
    with pytest.raises(CheckpointError, match=r"has no config\.json; it is not a Hugging Face checkpoint folder"):
        estimate_folder(cache.parent)


def test_remove_goes_through_the_hub_cache_api(cache, mixtral_checkpoint):
    place_in_cache(cache, "someone/tiny-mixtral", mixtral_checkpoint)
    size = sum(f.stat().st_size for f in mixtral_checkpoint.iterdir())
    assert remove_cached("someone/tiny-mixtral") == size  # a dry run: nothing is deleted
    assert find_cached("someone/tiny-mixtral") is not None
    assert remove_cached("someone/tiny-mixtral", execute=True) == size
    assert find_cached("someone/tiny-mixtral") is None
    assert not repo_folder(cache, "someone/tiny-mixtral").exists()
    with pytest.raises(HubError, match="'someone/tiny-mixtral' is not in the Hugging Face cache at "):
        remove_cached("someone/tiny-mixtral")


def test_cli_info_on_a_local_folder(capsys, mixtral_checkpoint):
    from engine.cli.main import main as moescope

    assert moescope(["models", "info", str(mixtral_checkpoint), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["estimate"]["num_experts"] == 8 and report["verdict"]["kind"] in ("fits-ram", "fits-gpu")
    assert moescope(["models", "info", "not a model"]) == 2
    assert "'not a model' is neither a folder here nor a Hub model id" in capsys.readouterr().err
