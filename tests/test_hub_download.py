"""Downloads through huggingface_hub against a local fake Hub: progress, resume, cancel, errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from engine.hub.download import DownloadProgress, download_model
from engine.hub.errors import (
    DiskFullError,
    DownloadCancelled,
    GatedRepoError,
    HubError,
    NetworkError,
    OfflineError,
    RepoNotFoundError,
)
from engine.hub.paths import repo_folder
from tests.helpers.hub.fake_hub import FakeHub

REPO = "moescope-test/tiny-mixtral"
FIXTURES = Path(__file__).parent / "helpers" / "hub"


@pytest.fixture
def online(monkeypatch):
    """The Hub may be contacted (conftest sets HF_HUB_OFFLINE=1 for every other test)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)  # many chunks even for a tiny checkpoint


@pytest.fixture
def hub(online):
    with FakeHub() as server:
        yield server


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory, mixtral_checkpoint) -> Path:
    """The tiny Mixtral in three shards with an index, as large Hub checkpoints are laid out."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("sharded") / "tiny-mixtral"
    AutoModelForCausalLM.from_pretrained(mixtral_checkpoint).save_pretrained(path, max_shard_size="200KB")
    for f in mixtral_checkpoint.iterdir():
        if not f.name.endswith(".safetensors") and not (path / f.name).exists():
            shutil.copy(f, path / f.name)
    assert len(list(path.glob("*.safetensors"))) >= 3 and (path / "model.safetensors.index.json").exists()
    return path


def add_tiny_repo(hub: FakeHub, folder: Path, repo_id: str = REPO, **kwargs):
    # files a download must leave alone: pickles, a consolidated copy, a sub-folder, docs
    extra = {"pytorch_model.bin": b"\0" * 64, "consolidated.safetensors": 10**6, "original/model.safetensors": 10**6,
             "README.md": b"# tiny"}
    return hub.add_folder(repo_id, folder, extra=extra, **kwargs)


def shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def test_download_fills_the_hf_cache_with_progress(hub, sharded_checkpoint, tmp_path):
    repo = add_tiny_repo(hub, sharded_checkpoint)
    events: list[DownloadProgress] = []
    snapshot = download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False, on_progress=events.append)

    assert snapshot == repo_folder(tmp_path, REPO) / "snapshots" / repo.sha
    assert (repo_folder(tmp_path, REPO) / "refs" / "main").read_text() == repo.sha
    expected = sorted(p.name for p in sharded_checkpoint.iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == expected
    for name in expected:
        assert (snapshot / name).is_symlink()  # the standard layout: snapshot links into blobs/
        assert (snapshot / name).read_bytes() == (sharded_checkpoint / name).read_bytes()
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.gets()}
    assert not fetched & {"pytorch_model.bin", "consolidated.safetensors", "README.md"}
    assert not any("original/" in r.path for r in hub.requests)

    done = [e.bytes_done for e in events]
    assert done == sorted(done), "progress never goes backwards"
    last = events[-1]
    assert last.finished and last.fraction == 1.0 and last.bytes_done == last.bytes_total
    looked_up = {"config.json", "model.safetensors.index.json"}  # fetched by the look-up before the download
    assert last.bytes_total == sum((sharded_checkpoint / n).stat().st_size for n in expected if n not in looked_up)
    assert {e.filename for e in events} >= set(shards(sharded_checkpoint))
    assert any(e.bytes_per_s > 0 and e.eta_s is not None for e in events[:-1])
    assert last.to_load_progress().fraction == 1.0 and REPO in last.to_load_progress().message


def test_second_download_reuses_the_cache(hub, sharded_checkpoint, tmp_path):
    add_tiny_repo(hub, sharded_checkpoint)
    first = download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False)
    hub.requests.clear()
    assert download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False) == first
    assert hub.gets(".safetensors") == []


def test_dropped_connection_is_resumed_with_a_range_request(hub, sharded_checkpoint, tmp_path):
    add_tiny_repo(hub, sharded_checkpoint)
    shard = shards(sharded_checkpoint)[1]
    hub.drop_once.add((REPO, shard))
    events: list[DownloadProgress] = []
    snapshot = download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False, on_progress=events.append)

    requests = hub.gets(shard)
    assert len(requests) == 2 and requests[0].range is None
    assert requests[1].range is not None and requests[1].range.startswith("bytes=")
    assert int(requests[1].range.removeprefix("bytes=").rstrip("-")) > 0, "resumed where it stopped, not from 0"
    assert (snapshot / shard).read_bytes() == (sharded_checkpoint / shard).read_bytes()
    assert all(e.bytes_done <= e.bytes_total for e in events), "the resumed bytes are not counted twice"
    assert events[-1].bytes_done == events[-1].bytes_total


def test_cancel_stops_between_chunks_and_a_new_run_fetches_only_the_rest(hub, sharded_checkpoint, tmp_path):
    add_tiny_repo(hub, sharded_checkpoint)
    first, second, *_ = shards(sharded_checkpoint)
    cancel = threading.Event()

    def on_progress(p: DownloadProgress) -> None:
        if p.filename == second:
            cancel.set()  # as the GUI's Cancel button would, from its thread

    with pytest.raises(DownloadCancelled) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False, on_progress=on_progress, cancel=cancel)
    message = str(info.value)
    assert f"download of '{REPO}' cancelled" in message and "finished and are kept" in message
    assert "download it again to continue" in message
    blobs = repo_folder(tmp_path, REPO) / "blobs"
    assert not list(blobs.glob("*.incomplete")), "no partial file is left behind"
    assert len(hub.gets(second)) == 1  # it had started

    hub.requests.clear()
    snapshot = download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert hub.gets(first) == [], "finished files are not fetched again"
    assert len(hub.gets(second)) == 1
    for name in shards(sharded_checkpoint):
        assert (snapshot / name).read_bytes() == (sharded_checkpoint / name).read_bytes()


def test_a_truncated_weight_file_is_named_after_the_download(hub, mixtral_checkpoint, tmp_path):
    data = (mixtral_checkpoint / "model.safetensors").read_bytes()
    files = {p.name: p.read_bytes() for p in mixtral_checkpoint.iterdir()} | {"model.safetensors": data[: len(data) // 2]}
    hub.add_repo(REPO, files)  # the Hub itself holds a broken file: sizes agree, content does not
    with pytest.raises(HubError) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False)
    message = str(info.value)
    assert "model.safetensors is truncated" in message
    assert message.endswith(f"(the broken copy stays in the cache until you run `moescope models remove {REPO} --yes`)")


def test_missing_repo(hub, tmp_path):
    with pytest.raises(RepoNotFoundError) as info:
        download_model("nobody/no-such-model", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert str(info.value) == (
        "no model 'nobody/no-such-model' on the Hugging Face Hub (or it is private and you are not logged in); "
        "check the name, e.g. with `moescope models search mixtral`"
    )


def test_gated_repo(hub, mixtral_checkpoint, tmp_path):
    hub.add_folder("gated-org/tiny-gated", mixtral_checkpoint, gated=True)
    with pytest.raises(GatedRepoError) as info:
        download_model("gated-org/tiny-gated", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert str(info.value) == (
        f"'gated-org/tiny-gated' is gated: accept its terms at {hub.url}/gated-org/tiny-gated while logged in, "
        "then log in here with `hf auth login` (or set HF_TOKEN) and try again"
    )
    assert not list(tmp_path.rglob("*.safetensors"))


def test_not_enough_disk_is_said_before_anything_big_is_fetched(hub, sharded_checkpoint, tmp_path):
    add_tiny_repo(hub, sharded_checkpoint)
    with pytest.raises(DiskFullError) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False, free_disk_bytes=1000)
    message = str(info.value)
    assert message.startswith(f"not enough disk space for '{REPO}': the download needs ")
    assert f"{tmp_path} has 1000 B free" in message and "point HF_HUB_CACHE at a bigger disk" in message
    assert hub.gets(".safetensors") == []


class _FillsUp:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, inner, room: int) -> None:
        self.inner, self.room = inner, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_disk_filling_up_during_the_download(hub, sharded_checkpoint, tmp_path, monkeypatch):
    from huggingface_hub import file_download

    add_tiny_repo(hub, sharded_checkpoint)
    real_http_get = file_download.http_get
    monkeypatch.setattr(file_download, "http_get",
                        lambda url, temp_file, **kw: real_http_get(url, _FillsUp(temp_file, 100_000), **kw))
    with pytest.raises(DiskFullError) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint=hub.url, token=False)
    message = str(info.value)
    first = shards(sharded_checkpoint)[0]
    assert message.startswith(f"the disk holding {tmp_path} filled up while downloading {first} of '{REPO}': free at least ")
    assert message.endswith("and run the download again; finished files are kept")
    assert not list((repo_folder(tmp_path, REPO) / "blobs").glob("*.incomplete"))


def test_offline_mode_says_how_to_go_online(tmp_path):
    # HF_HUB_OFFLINE=1 from conftest, as a user who set it would have it
    with pytest.raises(OfflineError) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint="http://127.0.0.1:9", token=False)
    assert str(info.value).startswith(f"HF_HUB_OFFLINE is set, so the Hub is not contacted for '{REPO}': unset it")


def test_unreachable_hub(online, tmp_path):
    with pytest.raises(NetworkError) as info:
        download_model(REPO, cache_dir=tmp_path, endpoint="http://127.0.0.1:9", token=False)
    assert str(info.value).startswith(f"cannot reach the Hugging Face Hub at http://127.0.0.1:9 for '{REPO}'")


def test_cli_download_info_list_remove(hub, mixtral_checkpoint, tmp_path, monkeypatch, capsys):
    from engine.cli.main import main as moescope

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "")
    repo = hub.add_folder(REPO, mixtral_checkpoint)

    hub.add_repo("Qwen/Qwen3-30B-A3B", {"config.json": (FIXTURES / "qwen3-30b-a3b.json").read_bytes(),
                                        "model-00001-of-00001.safetensors": 61_064_245_248})
    assert moescope(["models", "info", "Qwen/Qwen3-30B-A3B"]) == 0  # leaves its config.json in the cache
    out = capsys.readouterr().out
    assert "experts          128 per layer x 48 MoE layers, top-8; 9.00 MiB per expert (bfloat16)" in out
    assert "files            download 56.87 GiB (1 file)" in out

    assert moescope(["models", "info", REPO]) == 0
    out = capsys.readouterr().out
    assert f"model            {REPO} (MixtralForCausalLM, mixtral)" in out
    assert "experts          8 per layer x 3 MoE layers, top-2" in out
    assert "verdict          fits in RAM" in out

    assert moescope(["models", "download", REPO]) == 0
    out, err = capsys.readouterr()
    snapshot = repo_folder(tmp_path, REPO) / "snapshots" / repo.sha
    assert out.strip() == str(snapshot)
    assert f"chat with it: moescope chat --model {snapshot} --budget all" in err

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert moescope(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert f"{REPO}  [downloaded, " in out
    assert "Qwen/Qwen3-30B-A3B  [not downloaded, about 56.87 GiB; offline (HF_HUB_OFFLINE is set)]" in out
    assert "Qwen/Qwen3-30B-A3B-Instruct-2507  [not downloaded]" in out and "offline" in out

    assert moescope(["models", "remove", REPO]) == 1
    assert "pass --yes to delete it" in capsys.readouterr().err
    assert snapshot.exists()
    assert moescope(["models", "remove", REPO, "--yes"]) == 0
    assert f"deleted '{REPO}'" in capsys.readouterr().out
    assert not repo_folder(tmp_path, REPO).exists()


def test_cli_list_without_a_reachable_hub_asks_it_once(online, tmp_path, monkeypatch, capsys):
    from engine.cli.main import main as moescope

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert moescope(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["verdict"].startswith("cannot reach the Hugging Face Hub at http://127.0.0.1:9")
    assert {r["verdict"] for r in rows[1:]} == {"the Hub is not reachable: sizes unknown"}
