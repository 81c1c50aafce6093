"""Models LM Studio and Ollama downloaded: listed with their source, quant type and fit verdict, sized
from the GGUF header, opened where they lie. HOME and OLLAMA_MODELS point at tmp folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.hub.gguf_info import estimate_gguf, read_header
from engine.hub.lmstudio import lmstudio_model_dirs
from engine.process.library_service import estimate_model, list_library
from tests.helpers.checkpoints import reference_generate
from tests.helpers.library_ggufs import EXPERT_FFN, HIDDEN, write_moe_gguf, write_ollama_model

PROMPT = [1, 17, 42, 9, 77, 5]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # LM Studio's and Ollama's default folders live under it
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    return home


def found(entries, source: str) -> dict:
    return {e.title: e for e in entries if e.source == source}


def test_lmstudio_ggufs_and_checkpoint_folders_are_listed_with_verdicts(home, mixtral_checkpoint):
    repo = home / ".lmstudio" / "models" / "lmstudio-community" / "Qwen3-MoE-Tiny-GGUF"
    q8 = write_moe_gguf(repo / "Qwen3-MoE-Tiny-Q8_0.gguf")
    q4 = write_moe_gguf(repo / "Qwen3-MoE-Tiny-Q4_K_M.gguf", quant="Q4_K", file_type="MOSTLY_Q4_K_M")
    split = write_moe_gguf(home / ".lmstudio" / "models" / "someone" / "Split-GGUF" / "split-Q8_0.gguf",
                           split_max_tensors=8)
    shutil.copy(q8, repo / "mmproj-Qwen3-MoE-Tiny-F16.gguf")  # a vision projector: not a model of its own
    write_moe_gguf(home / ".lmstudio" / "models" / "someone" / "Dense-GGUF" / "dense-Q8_0.gguf", arch="llama",
                   experts=0)
    write_moe_gguf(home / ".lmstudio" / "models" / "someone" / "Odd-GGUF" / "odd-Q8_0.gguf", arch="grok")
    shutil.copytree(mixtral_checkpoint, home / ".lmstudio" / "models" / "mlx-community" / "Tiny-Mixtral")

    lm = found(list_library(), "lmstudio")
    assert sorted(lm) == ["lmstudio-community/Qwen3-MoE-Tiny-GGUF/Qwen3-MoE-Tiny-Q4_K_M.gguf",
                          "lmstudio-community/Qwen3-MoE-Tiny-GGUF/Qwen3-MoE-Tiny-Q8_0.gguf",
                          "mlx-community/Tiny-Mixtral", "someone/Odd-GGUF/odd-Q8_0.gguf",
                          "someone/Split-GGUF/split-Q8_0-00001-of-00003.gguf"]  # no dense model, no projector
    entry = lm["lmstudio-community/Qwen3-MoE-Tiny-GGUF/Qwen3-MoE-Tiny-Q4_K_M.gguf"]
    assert (entry.repo_id, entry.local_path, entry.quant, entry.model_type) == (str(q4), str(q4), "Q4_K_M", "qwen3_moe")
    assert entry.downloaded and entry.problem is None and entry.fit_kind == "fits-ram"
    assert entry.fit_headline.startswith("fits in RAM") and entry.size_bytes == q4.stat().st_size
    assert lm["someone/Split-GGUF/split-Q8_0-00001-of-00003.gguf"].local_path == str(split)
    assert lm["someone/Split-GGUF/split-Q8_0-00001-of-00003.gguf"].size_bytes == sum(
        p.stat().st_size for p in split.parent.glob("*.gguf"))
    odd = lm["someone/Odd-GGUF/odd-Q8_0.gguf"]
    assert odd.fit_kind == "unsupported" and odd.problem.startswith(
        "GGUF architecture 'grok' cannot be mapped to a model MoEScope runs; GGUF architectures that work: qwen3moe")
    assert odd.fit_headline == f"cannot run yet: {odd.problem}"
    folder = lm["mlx-community/Tiny-Mixtral"]
    assert (folder.model_type, folder.fit_kind, folder.problem) == ("mixtral", "fits-ram", None)

    # the estimate the dialog asks for on selection reads the same header
    est = estimate_model(str(q8))
    assert (est.downloaded, est.local_path, est.num_experts, est.num_moe_layers, est.top_k) == (True, str(q8), 8, 2, 2)
    assert est.kind == "fits-ram" and est.budget == "all" and est.formats[0].format == "original"


def test_the_header_gives_expert_and_dense_bytes_in_the_files_own_types(tmp_path):
    q4 = write_moe_gguf(tmp_path / "m.gguf", quant="Q4_K", file_type="MOSTLY_Q4_K_M", layers=3, experts=16, top_k=4)
    est = estimate_gguf(read_header(q4))
    one_matrix = EXPERT_FFN * HIDDEN // 256 * 144  # Q4_K: 144 bytes per 256 weights
    assert est.bytes_per_expert == 3 * one_matrix and est.expert_bytes == 3 * 16 * 3 * one_matrix
    assert (est.num_experts, est.num_moe_layers, est.top_k, est.quantization) == (16, 3, 4, "GGUF Q4_K_M")
    assert est.min_budget_bytes == 4 * 3 * est.bytes_per_expert
    assert est.dense_bytes + est.expert_bytes < q4.stat().st_size  # plus the header and alignment
    assert est.download_bytes == q4.stat().st_size


def test_a_settings_folder_and_the_old_cache_folder_are_searched(home, tmp_path):
    elsewhere = tmp_path / "big-disk" / "lm-models"
    (home / ".lmstudio").mkdir()
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(elsewhere)}))
    write_moe_gguf(elsewhere / "pub" / "Moved-GGUF" / "moved-Q8_0.gguf")
    write_moe_gguf(home / ".cache" / "lm-studio" / "models" / "pub" / "Old-GGUF" / "old-Q8_0.gguf")
    assert lmstudio_model_dirs() == [elsewhere, home / ".cache" / "lm-studio" / "models"]
    assert sorted(found(list_library(), "lmstudio")) == ["pub/Moved-GGUF/moved-Q8_0.gguf", "pub/Old-GGUF/old-Q8_0.gguf"]


def test_ollama_manifests_point_at_gguf_blobs(home, tmp_path, monkeypatch):
    models = tmp_path / "ollama-store"
    monkeypatch.setenv("OLLAMA_MODELS", str(models))  # as Ollama itself reads it
    source = write_moe_gguf(tmp_path / "src" / "qwen.gguf", quant="Q4_K", file_type="MOSTLY_Q4_K_M")
    blob = write_ollama_model(models, source, "qwen3", "30b-a3b")
    write_ollama_model(models, write_moe_gguf(tmp_path / "src" / "dense.gguf", arch="llama", experts=0), "llama3")
    write_ollama_model(models, source, "mixer", "q4", namespace="someone")
    gone = write_ollama_model(models, write_moe_gguf(tmp_path / "src" / "gone.gguf", layers=1), "gone")
    gone.unlink()
    broken = models / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")

    ol = found(list_library(), "ollama")
    assert sorted(ol) == ["broken:latest", "gone:latest", "qwen3:30b-a3b", "someone/mixer:q4"]  # llama3 is dense
    qwen = ol["qwen3:30b-a3b"]
    assert (qwen.local_path, qwen.quant, qwen.fit_kind, qwen.problem) == (str(blob), "Q4_K_M", "fits-ram", None)
    assert ol["broken:latest"].problem == (f"Ollama manifest {broken} is not a readable manifest; "
                                           "`ollama pull broken:latest` again")
    assert ol["gone:latest"].problem == (f"Ollama's model file {gone.name} for gone:latest is missing from "
                                         f"{gone.parent}; `ollama pull gone:latest` again")
    assert ol["gone:latest"].local_path is None and ol["gone:latest"].fit_kind == "unsupported"
    assert estimate_model(str(blob)).num_experts == 8  # a blob has no .gguf suffix: known by its magic


def test_a_split_set_with_a_part_missing_names_the_part(home):
    first = write_moe_gguf(home / ".lmstudio" / "models" / "p" / "S-GGUF" / "s-Q8_0.gguf", split_max_tensors=8)
    (first.parent / "s-Q8_0-00002-of-00003.gguf").unlink()
    [entry] = found(list_library(), "lmstudio").values()
    # the loader's own line (engine.model.gguf.file.split_parts), the same the library shows
    assert entry.problem == ("'s-Q8_0-00001-of-00003.gguf' is part of a split GGUF set of 3 files, and "
                             f"s-Q8_0-00002-of-00003.gguf is missing from {first.parent}; download every part "
                             "into the same folder")


def test_a_deepseek2_gguf_the_loader_refuses_is_listed_with_its_line(home):
    # DeepSeek-V2 and V3 share llama.cpp's deepseek2: V2 routes by softmax (gating 1) without the
    # correction bias V3's sigmoid routing (2) has; these files carry no bias
    folder = home / ".lmstudio" / "models" / "p"
    write_moe_gguf(folder / "V2-GGUF" / "v2-Q8_0.gguf", arch="deepseek2", gating=1)
    write_moe_gguf(folder / "Odd-GGUF" / "odd-Q8_0.gguf", arch="deepseek2", gating=2)
    entries = {title.split("/")[-1]: e for title, e in found(list_library(), "lmstudio").items()}
    assert entries["v2-Q8_0.gguf"].problem is None
    assert entries["odd-Q8_0.gguf"].problem == (
        "odd-Q8_0.gguf is a deepseek2 GGUF routing by sigmoid without a correction bias, which neither "
        "DeepSeek-V2 nor V3 does; open the original checkpoint")


def test_a_truncated_gguf_is_listed_with_its_problem(home):
    path = write_moe_gguf(home / ".lmstudio" / "models" / "p" / "T-GGUF" / "t-Q8_0.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    [entry] = found(list_library(), "lmstudio").values()
    assert entry.problem.startswith(f"{path} is truncated") and entry.problem.endswith("download it again")
    assert "\n" not in entry.problem


def test_an_lmstudio_checkpoint_folder_opens_where_it_lies(home, mixtral_checkpoint):
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    folder = home / ".lmstudio" / "models" / "mlx-community" / "Tiny-Mixtral"
    shutil.copytree(mixtral_checkpoint, folder)
    [entry] = found(list_library(), "lmstudio").values()
    runtime = MoERuntime(LoadModel(path=entry.local_path, budget="1", store="disk", device="cpu"))
    try:
        result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=6))
    finally:
        runtime.close()
    assert result.token_ids == reference_generate(mixtral_checkpoint, PROMPT, 6)


def test_the_header_parser_agrees_with_the_gguf_package(tmp_path):
    import gguf

    from engine.model.gguf.header import parse_header

    path = write_moe_gguf(tmp_path / "m.gguf", quant="Q4_K", file_type="MOSTLY_Q4_K_M", vocabulary=3000)
    parsed = parse_header(path.read_bytes())
    reader = gguf.GGUFReader(path)
    assert [(t[0], t[1], t[2], t[3], t[4]) for t in parsed.tensors] == [
        (t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), int(t.data_offset) + int(t.n_bytes))
        for t in reader.tensors]
    assert parsed.data_start == reader.data_offset
    assert parsed.metadata["qwen3moe.expert_count"] == 8 and parsed.metadata["general.name"] == "Tiny MoE"
    assert "tokenizer.ggml.tokens" not in parsed.metadata  # stepped over, not kept


def test_the_command_line_lists_and_sizes_them(home, capsys):
    from engine.cli.main import main as moescope

    gguf = write_moe_gguf(home / ".lmstudio" / "models" / "pub" / "Q-GGUF" / "q-Q4_K_M.gguf", quant="Q4_K",
                          file_type="MOSTLY_Q4_K_M")
    assert moescope(["models", "list", "--json"]) == 0
    [row] = [r for r in json.loads(capsys.readouterr().out) if r.get("source") == "lmstudio"]
    assert (row["repo"], row["path"], row["description"]) == ("pub/Q-GGUF/q-Q4_K_M.gguf", str(gguf), "LM Studio, Q4_K_M")
    assert row["verdict"].startswith("fits in RAM") and row["budget"] == "all"

    assert moescope(["models", "info", str(gguf)]) == 0
    out = capsys.readouterr().out
    assert "(GGUF qwen3moe, qwen3_moe)" in out and "8 per layer x 2 MoE layers, top-2" in out
    assert f"Q4_K_M GGUF in {gguf}" in out and "verdict          fits in RAM" in out
