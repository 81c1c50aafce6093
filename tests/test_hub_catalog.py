"""The curated catalog, the families the engine runs, file selection, and Hub search."""

from __future__ import annotations

import json

import pytest

from engine.hub.catalog import catalog_path, load_catalog
from engine.hub.remote import REPO_ID, search_models, select_files
from engine.hub.supported import supported_model_types
from tests.helpers.checkpoints import FAMILIES
from tests.helpers.hub.fake_hub import FakeHub


def test_catalog_lists_hub_ids_and_descriptions_only():
    entries = load_catalog()
    assert len(entries) >= 10
    ids = [e.repo_id for e in entries]
    assert len(set(ids)) == len(ids)
    for e in entries:
        assert REPO_ID.match(e.repo_id), e.repo_id
        assert e.description and "\n" not in e.description and len(e.description) < 140
    raw = json.loads(catalog_path().read_text())
    assert all(set(m) == {"repo", "description"} for m in raw["models"]), "sizes and configs come from the Hub"


def test_supported_families_come_from_transformers():
    types = supported_model_types()
    for family in FAMILIES:  # every family the engine is tested on
        assert family in types
    assert {"deepseek_v2", "qwen3_moe", "granitemoe", "phimoe"} <= types
    assert not {"llama", "mistral", "qwen2", "gpt2"} & types  # dense families


def test_select_files_fetches_only_what_the_engine_needs():
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
             "consolidated.safetensors", "pytorch_model.bin", "original/model.safetensors", "metal/model.bin",
             "chat_template.jinja", ".gitattributes", "special_tokens_map.json"]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    assert select_files(names, index) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors.index.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ]
    assert "consolidated.safetensors" in select_files(["consolidated.safetensors", "config.json"], None)


@pytest.fixture
def online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def config(model_type: str, **extra) -> bytes:
    return json.dumps({"model_type": model_type, **extra}).encode()


def test_search_keeps_moe_families_the_engine_runs(online, monkeypatch, capsys):
    with FakeHub() as hub:
        hub.add_repo("org/tiny-mixtral-chat", {"config.json": config("mixtral"), "model.safetensors": 4000},
                     downloads=50)
        hub.add_repo("org/tiny-llama-chat", {"config.json": config("llama"), "model.safetensors": 4000}, downloads=90)
        hub.add_repo("org/tiny-oss", {"config.json": config("gpt_oss", quantization_config={"quant_method": "mxfp4"}),
                                      "model.safetensors": 4000}, downloads=10, gated=True)
        hub.add_repo("org/tiny-gguf", {"model.gguf": 100}, downloads=70)
        hub.add_repo("org/other-qwen-moe", {"config.json": config("qwen3_moe")})
        hits = search_models("tiny", endpoint=hub.url, token=False)
        assert [h.repo_id for h in hits] == ["org/tiny-mixtral-chat", "org/tiny-oss"]  # most downloaded first
        assert (hits[0].model_type, hits[0].params, hits[0].quantization, hits[0].gated) == ("mixtral", 1000, None, False)
        assert (hits[1].quantization, hits[1].gated) == ("mxfp4", True)
        assert search_models("tiny", limit=1, endpoint=hub.url, token=False)[0].repo_id == "org/tiny-mixtral-chat"

        from engine.cli.main import main as moescope

        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert moescope(["models", "search", "tiny"]) == 0
        out = capsys.readouterr().out
        assert "org/tiny-mixtral-chat" in out and "org/tiny-llama-chat" not in out
        assert "gated, mxfp4" in out and "not runnable" not in out  # MXFP4 checkpoints run
        assert moescope(["models", "search", "nothing-like-this"]) == 0
        assert "no MoE models MoEScope can run match 'nothing-like-this'" in capsys.readouterr().out
