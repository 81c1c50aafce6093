"""The model library through the engine process: a real spawned worker, a local fake Hub, a tmp HF cache.

Listing, search and the fit estimate answer between requests; a download runs on its own thread,
so chatting goes on beside it, a second one is refused, Cancel stops it, and no failure ends the
worker. Waits end on events (or on the fake Hub's hold point), never on a timer.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import protocol as p
from engine.process.client import EngineClient
from engine.process.library_service import LibraryService
from tests.helpers.checkpoints import save_tiny_checkpoint
from tests.helpers.engine_events import EventLog, started_client
from tests.helpers.hub.library_hub import HoldingHub, fill_hub, hub_environment, padding_weights, place_in_cache
from tests.helpers.library_ggufs import write_moe_gguf, write_ollama_model

pytestmark = pytest.mark.process

START_S = 180  # the first answer waits for the worker to import torch on a busy machine
CATALOG = [m["repo"] for m in json.loads((Path(__file__).parents[1] / "resources" / "catalog.json").read_text())["models"]]
MISSING = "nobody/no-such-model"
NOT_FOUND = (f"no model '{MISSING}' on the Hugging Face Hub (or it is private and you are not logged in); "
             "check the name, e.g. with `moescope models search mixtral`")


@dataclass
class Library:
    client: EngineClient
    log: EventLog
    hub: HoldingHub
    cache: Path
    ids: dict[str, str]
    cached_snapshot: Path

    def ask(self, command, predicate, timeout: float = 60.0):
        start = self.log.mark()
        self.client.send(command)
        return self.log.wait_for(predicate, timeout, start)


@pytest.fixture(scope="module")
def endless(tmp_path_factory) -> Path:
    """No EOS: a reply runs to max_new_tokens, so there is a reply to act on mid-stream."""
    return save_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("library-endless") / "mixtral", eos_token_id=None)


@pytest.fixture(scope="module")
def library(tmp_path_factory, mixtral_checkpoint):
    cache = tmp_path_factory.mktemp("library-hf-cache")
    with HoldingHub(lifetime_s=1200) as hub:
        ids = fill_hub(hub, mixtral_checkpoint)
        snapshot = place_in_cache(cache, "someone/cached-mixtral", mixtral_checkpoint)
        place_in_cache(cache, "someone/no-weights", mixtral_checkpoint, skip=("model.safetensors",))
        ollama = tmp_path_factory.mktemp("ollama-store")
        write_ollama_model(ollama, write_moe_gguf(tmp_path_factory.mktemp("gguf") / "q.gguf"), "qwen3", "tiny")
        with hub_environment(hub.url, cache):
            os.environ["OLLAMA_MODELS"] = str(ollama)
            try:
                client, log = started_client()  # the spawned worker copies the environment now
            finally:
                del os.environ["OLLAMA_MODELS"]
        try:
            log.wait_for(lambda e: isinstance(e, p.EngineStarted), START_S)
            yield Library(client, log, hub, cache, ids, snapshot)
        finally:
            client.stop()


def is_error(request_id: str):
    return lambda e: isinstance(e, p.Error) and e.request_id == request_id


def test_listing_is_the_catalog_then_the_runnable_cached_models(library):
    listing = library.ask(p.ListLibrary(), lambda e: isinstance(e, p.LibraryListing) and e.query is None)
    ids = [e.repo_id for e in listing.entries]
    assert ids[: len(CATALOG)] == CATALOG
    assert all(e.source == "catalog" and not e.downloaded and e.local_path is None for e in listing.entries[: len(CATALOG)])
    [cached, ollama] = listing.entries[len(CATALOG):]  # someone/no-weights has no weights: the engine cannot run it
    assert (ollama.title, ollama.source, ollama.quant, ollama.fit_kind) == ("qwen3:tiny", "ollama", "Q8_0", "fits-ram")
    assert "ollama-store" in ollama.local_path and "/blobs/sha256-" in ollama.local_path  # opened where it lies
    assert (cached.repo_id, cached.source, cached.downloaded, cached.model_type) == (
        "someone/cached-mixtral", "cache", True, "mixtral")
    assert cached.local_path == str(library.cached_snapshot)
    assert cached.size_bytes == sum(f.stat().st_size for f in library.cached_snapshot.iterdir())


def test_search_returns_the_hubs_moe_models_and_a_typed_id(library):
    found = library.ask(p.SearchLibrary("mixtral"), lambda e: isinstance(e, p.LibraryListing) and e.query == "mixtral")
    assert [(e.repo_id, e.source, e.model_type, e.downloads) for e in found.entries] == [
        (library.ids["tiny"], "search", "mixtral", 10), (library.ids["slow"], "search", "mixtral", 5)]
    assert found.entries[0].params and not found.entries[0].downloaded

    typed = library.ask(p.SearchLibrary(MISSING), lambda e: isinstance(e, p.LibraryListing) and e.query == MISSING)
    assert [(e.repo_id, e.source) for e in typed.entries] == [(MISSING, "search")]  # checked when estimated


def test_fit_estimates_from_the_cache_and_from_the_hub_and_a_missing_repo(library):
    local = library.ask(p.EstimateModel("someone/cached-mixtral"), lambda e: isinstance(e, p.FitEstimateReady))
    assert local.downloaded and local.local_path == str(library.cached_snapshot) and local.download_bytes == 0
    assert (local.kind, local.budget, local.num_experts, local.num_moe_layers, local.top_k) == ("fits-ram", "all", 8, 3, 2)
    assert local.headline.startswith("fits in RAM") and local.total_bytes == local.dense_bytes + local.expert_bytes

    qwen = library.ask(p.EstimateModel(library.ids["qwen"]), lambda e: isinstance(e, p.FitEstimateReady))
    assert (qwen.repo_id, qwen.downloaded, qwen.local_path) == (library.ids["qwen"], False, None)
    assert (qwen.num_experts, qwen.num_moe_layers, qwen.top_k, qwen.dtype) == (128, 48, 8, "bfloat16")
    assert qwen.download_bytes == 61_064_245_248 and qwen.expert_bytes == 128 * 48 * 9 * 1024**2
    assert qwen.headline and qwen.kind in ("fits-gpu", "fits-ram", "offload", "too-big")

    error = library.ask(p.EstimateModel(MISSING), is_error(p.library_request_id("estimate", MISSING)))
    assert (error.kind, error.message, error.recoverable) == ("repo-not-found", NOT_FOUND, True)


def test_download_runs_beside_a_reply_refuses_a_second_and_cancels(library, mixtral_checkpoint):
    slow, tiny, hub = library.ids["slow"], library.ids["tiny"], library.hub
    hub.hold_file(slow, "model.safetensors")
    loaded = library.ask(p.LoadModel(str(mixtral_checkpoint)), lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
    assert isinstance(loaded, p.ModelLoaded), loaded

    start = library.log.mark()
    library.client.send(p.DownloadModel(slow))
    assert hub.held.wait(60), "the download reached the Hub"
    busy = library.ask(p.DownloadModel(tiny), is_error(p.library_request_id("download", tiny)))
    assert busy.kind == "download-busy" and busy.message.startswith(f"'{slow}' is still downloading")

    # the worker chats while the download waits on the Hub
    done = library.ask(p.Generate("r1", prompt="Hello", sampling=p.SamplingSettings(temperature=0, max_new_tokens=6)),
                       lambda e: isinstance(e, p.Done) and e.request_id == "r1")
    assert done.finish_reason in ("length", "eos") and not hub.release.is_set()
    progress = [e for e in library.log.events[start:] if isinstance(e, p.DownloadProgress)]
    assert progress and progress[-1].repo_id == slow and progress[-1].bytes_total > 2 * 1024**2
    assert not any(isinstance(e, (p.DownloadFinished, p.Error)) and getattr(e, "request_id", "") != busy.request_id
                   for e in library.log.events[start:])

    library.ask(p.CancelDownload(slow), lambda e: isinstance(e, p.DownloadProgress) and e.cancelling)
    mark = library.log.mark()
    hub.release.set()  # the next chunk arrives, the download sees the cancel between chunks
    cancelled = library.log.wait_for(is_error(p.library_request_id("download", slow)), 60, mark)
    assert cancelled.kind == "cancelled" and cancelled.recoverable
    assert cancelled.message.startswith(f"download of '{slow}' cancelled: nothing was kept")

    # the slot is free again: the next download goes through, with progress, into the HF cache
    mark = library.log.mark()
    finished = library.ask(p.DownloadModel(tiny), lambda e: isinstance(e, (p.DownloadFinished, p.Error)))
    assert isinstance(finished, p.DownloadFinished), finished
    snapshot = Path(finished.path)
    assert snapshot.parent.parent == library.cache / "models--moescope-test--tiny-mixtral"
    for f in mixtral_checkpoint.iterdir():
        assert (snapshot / f.name).read_bytes() == f.read_bytes()
    steps = [e for e in library.log.events[mark:] if isinstance(e, p.DownloadProgress) and e.bytes_total]
    assert [e.bytes_done for e in steps] == sorted(e.bytes_done for e in steps), "progress never goes backwards"
    assert steps[-1].bytes_done == steps[-1].bytes_total > 0 and steps[-1].files_done == steps[-1].files_total

    listing = library.ask(p.ListLibrary(), lambda e: isinstance(e, p.LibraryListing) and e.query is None)
    entry = next(e for e in listing.entries if e.repo_id == tiny)
    assert entry.downloaded and entry.local_path == str(snapshot) and entry.source == "cache"


def test_a_download_starts_mid_reply_and_its_errors_leave_the_reply_alone(library, endless):
    slow, hub = library.ids["slow"], library.hub
    hub.hold_file(slow, "model.safetensors")
    loaded = library.ask(p.LoadModel(str(endless)), lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
    assert isinstance(loaded, p.ModelLoaded), loaded
    library.ask(p.Generate("long", prompt="Tell", sampling=p.SamplingSettings(temperature=0, max_new_tokens=200)),
                lambda e: isinstance(e, p.Token) and e.request_id == "long")
    mark = library.log.mark()
    library.client.send(p.DownloadModel(slow))
    library.client.send(p.ListLibrary())  # a quick local read: answered mid-reply too
    library.log.wait_for(lambda e: isinstance(e, p.DownloadProgress) and e.repo_id == slow, 60, mark)
    library.log.wait_for(lambda e: isinstance(e, p.LibraryListing), 60, mark)
    assert not any(isinstance(e, p.Done) for e in library.log.events[mark:]), "handled between tokens, not after"

    library.client.send(p.CancelDownload())  # None: whatever is downloading
    library.log.wait_for(lambda e: isinstance(e, p.DownloadProgress) and e.cancelling, 60, mark)
    hub.release.set()
    library.log.wait_for(is_error(p.library_request_id("download", slow)), 60, mark)
    done = library.log.wait_for(lambda e: isinstance(e, p.Done) and e.request_id == "long", 120, mark)
    assert done.finish_reason == "length" and len(done.token_ids) == 200  # the library's error was not the reply's


def test_failed_downloads_are_one_line_errors_and_the_worker_stays_up(library):
    missing = library.ask(p.DownloadModel(MISSING), is_error(p.library_request_id("download", MISSING)))
    assert (missing.kind, missing.message) == ("repo-not-found", NOT_FOUND)

    dense = "moescope-test/dense"
    library.hub.add_repo(dense, {"config.json": json.dumps({"model_type": "llama"}).encode(),
                                 "model.safetensors": padding_weights(1024)})
    refused = library.ask(p.DownloadModel(dense), is_error(p.library_request_id("download", dense)))
    assert refused.message == (f"MoEScope cannot run '{dense}' (model type 'llama' is not a mixture-of-experts "
                               "family MoEScope runs), so it is not downloaded")
    assert not list((library.cache / "models--moescope-test--dense").rglob("*.safetensors"))

    bad = library.ask(p.DownloadModel("not a repo id"), is_error(p.library_request_id("download", "not a repo id")))
    assert "is neither a folder here nor a Hub model id" in bad.message and "\n" not in bad.message
    assert library.client.alive
    library.ask(p.ListLibrary(), lambda e: isinstance(e, p.LibraryListing))


def test_a_crashing_download_thread_becomes_an_error_and_frees_the_slot(monkeypatch):
    import engine.process.library_service as service

    def explode(repo_id, quant, cancel, send):
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "_download", explode)
    errors: list[p.Error] = []
    got = threading.Event()

    def send(event) -> None:
        if isinstance(event, p.Error):
            errors.append(event)
            got.set()

    library = LibraryService(send)
    library.handle(p.DownloadModel("org/model"))
    assert got.wait(30)
    [error] = errors
    assert (error.kind, error.request_id) == ("internal", "library:download:org/model")
    assert error.message == "the download of 'org/model' failed: RuntimeError: boom"
    assert library.downloading is None  # freed before the error went out: the next download may start
