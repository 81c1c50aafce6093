"""GGUF repositories on the (fake) Hub: found by search, a verdict per quant file from one header fetched
with Range requests, and a download of only the quant file (set) picked, which then opens where it lies."""

from __future__ import annotations

import json
import threading

import pytest

from engine import protocol as p
from engine.hub.errors import HubError
from engine.hub.local import resolve_model
from engine.hub.remote_gguf import quant_label
from engine.process.library_service import _download, estimate_model, list_library, search_library
from tests.helpers.hub.fake_hub import FakeHub
from tests.helpers.library_ggufs import write_moe_gguf

REPO = "someone/Qwen3-MoE-Tiny-GGUF"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # conftest keeps every other test offline
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    q4 = write_moe_gguf(tmp_path / "src" / "Qwen3-MoE-Tiny-Q4_K_M.gguf", quant="Q4_K", file_type="MOSTLY_Q4_K_M")
    first = write_moe_gguf(tmp_path / "src" / "Q8_0" / "Qwen3-MoE-Tiny-Q8_0.gguf", split_max_tensors=8)
    parts = sorted(first.parent.glob("*.gguf"))
    files: dict[str, bytes | int] = {"README.md": b"# tiny", q4.name: q4.read_bytes(),
                                     "mmproj-F16.gguf": q4.read_bytes()}
    files.update({f"Q8_0/{part.name}": part.read_bytes() for part in parts})
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        server.add_repo(REPO, files, downloads=7, gguf={"architecture": "qwen3moe", "total": 1_000_000})
        dense = write_moe_gguf(tmp_path / "src" / "dense.gguf", arch="llama", experts=0)
        server.add_repo("someone/Llama-Tiny-GGUF", {"dense.gguf": dense.read_bytes()}, downloads=9,
                        gguf={"architecture": "llama", "total": 1000})
        for repo, arch in (("someone/gpt-oss-Tiny-GGUF", "gpt-oss"), ("someone/DeepSeek-V3-Tiny-GGUF", "deepseek2")):
            moe = write_moe_gguf(tmp_path / "src" / arch / "model-Q4_K_M.gguf", arch=arch, quant="Q4_K")
            server.add_repo(repo, {moe.name: moe.read_bytes()}, downloads=3, gguf={"architecture": arch, "total": 10})
        server.sizes = {"Q4_K_M": q4.stat().st_size, "Q8_0": sum(x.stat().st_size for x in parts)}  # type: ignore[attr-defined]
        server.parts = [f"Q8_0/{part.name}" for part in parts]  # type: ignore[attr-defined]
        yield server


def test_search_finds_moe_gguf_repos(hub):
    found = {entry.repo_id: entry for entry in search_library("tiny")}  # the llama GGUF names no Mixtral: left out
    assert {repo: (e.model_type, e.quant, e.problem) for repo, e in found.items()} == {
        REPO: ("qwen3_moe", "GGUF", None), "someone/gpt-oss-Tiny-GGUF": ("gpt_oss", "GGUF", None),
        "someone/DeepSeek-V3-Tiny-GGUF": ("deepseek_v3", "GGUF", None)}
    assert found[REPO].description == "qwen3_moe GGUF on the Hub: pick a quant file"


def test_each_quant_file_has_its_own_verdict_from_one_fetched_header(hub):
    est = estimate_model(REPO)
    assert [(q.label, q.size_bytes, q.local_path) for q in est.quants] == [
        ("Q4_K_M", hub.sizes["Q4_K_M"], None), ("Q8_0", hub.sizes["Q8_0"], None)]  # no projector, split set as one
    assert est.quants[1].files == hub.parts
    assert all(q.kind == "fits-ram" and q.headline.startswith("fits in RAM") and q.budget == "all" for q in est.quants)
    assert est.quant == "Q8_0" and (est.num_experts, est.num_moe_layers, est.top_k) == (8, 2, 2)  # most precise that fits
    assert not est.downloaded and est.download_bytes == hub.sizes["Q8_0"]
    gguf_gets = hub.gets(".gguf")
    assert [r.path.rsplit("/", 1)[-1] for r in gguf_gets] == ["Qwen3-MoE-Tiny-Q4_K_M.gguf"]  # one header, no more
    assert gguf_gets[0].range == f"bytes=0-{8 * 1024**2 - 1}"


def test_download_fetches_only_the_picked_quant_then_it_is_listed_and_opens(hub, tmp_path):
    with pytest.raises(HubError, match=rf"^'{REPO}' is a GGUF repo: pick one of its quant files to download "
                                       r"\(Q4_K_M, Q8_0\)$"):
        _download(REPO, "", threading.Event(), lambda event: None)
    progress: list[p.DownloadProgress] = []
    path = _download(REPO, "q8_0", threading.Event(), progress.append)
    assert path.name == "Qwen3-MoE-Tiny-Q8_0-00001-of-00003.gguf" and path.parent.name == "Q8_0"
    fetched = sorted(r.path.split("/resolve/")[1].split("/", 1)[1] for r in hub.gets(".gguf") if not r.range)
    assert fetched == hub.parts  # every part of the set, nothing else
    assert progress[-1].bytes_done == hub.sizes["Q8_0"]

    [entry] = [e for e in list_library() if e.source == "cache"]
    assert (entry.title, entry.local_path, entry.quant, entry.fit_kind) == (
        f"{REPO}/Q8_0/{path.name}", str(path), "Q8_0", "fits-ram")
    est = estimate_model(REPO)  # the downloaded header is read; only Q4_K_M is scaled from it
    assert [q.local_path for q in est.quants] == [None, str(path)]
    assert est.local_path == str(path) and est.downloaded
    assert resolve_model(REPO) == path  # one GGUF downloaded: the repo id opens it


def test_quant_labels_from_file_names():
    assert quant_label("Qwen3-30B-A3B-UD-Q4_K_XL.gguf") == "Q4_K_XL"
    assert quant_label("BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf") == "BF16"
    assert quant_label("gpt-oss-20b-MXFP4.gguf") == "MXFP4"
    assert quant_label("model-IQ2_XXS.gguf") == "IQ2_XXS"


def test_the_command_line_shows_the_quant_files_and_downloads_one(hub, capsys):
    from engine.cli.main import main as moescope

    assert moescope(["models", "info", REPO]) == 0
    out = capsys.readouterr().out
    assert f"{REPO} (GGUF qwen3moe, qwen3_moe, Q8_0 of 2 quant files below)" in out
    assert "  Q4_K_M " in out and "(--quant Q4_K_M)" in out and "(--quant Q8_0)" in out

    assert moescope(["models", "download", REPO]) == 2
    assert f"'{REPO}' is a GGUF repo: pick one of its quant files to download (Q4_K_M, Q8_0)" in capsys.readouterr().err
    assert moescope(["models", "download", REPO, "--quant", "Q4_K_M"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith("/Qwen3-MoE-Tiny-Q4_K_M.gguf")
    assert [r.path.rsplit("/", 1)[-1] for r in hub.gets(".gguf") if not r.range] == ["Qwen3-MoE-Tiny-Q4_K_M.gguf"]

    assert moescope(["models", "list", "--json"]) == 0
    [row] = [r for r in json.loads(capsys.readouterr().out) if r.get("source") == "cache"]
    assert (row["repo"], row["path"]) == (f"{REPO}/Qwen3-MoE-Tiny-Q4_K_M.gguf", path)
    assert row["verdict"].startswith("fits in RAM")


def test_a_header_longer_than_the_first_fetch_is_fetched_in_growing_ranges(hub, tmp_path, monkeypatch):
    import engine.hub.remote_gguf as remote_gguf

    big = write_moe_gguf(tmp_path / "src" / "Big-Q8_0.gguf", vocabulary=3000)  # ~60 KB of tokenizer metadata
    hub.add_repo("someone/Big-Vocab-GGUF", {big.name: big.read_bytes()}, gguf={"architecture": "qwen3moe"})
    monkeypatch.setattr(remote_gguf, "HEADER_BYTES", 4096)
    est = estimate_model("someone/Big-Vocab-GGUF")
    assert [q.label for q in est.quants] == ["Q8_0"] and est.num_experts == 8 and est.kind == "fits-ram"
    ranges = [int(r.range.split("-")[1]) + 1 for r in hub.gets("Big-Q8_0.gguf")]
    assert ranges[0] == 4096 and ranges == sorted(ranges) and len(ranges) >= 2
    assert ranges[-1] < big.stat().st_size  # the header, not the whole file
