"""The model library inside the engine process: what the GUI's library dialog asks for.

Listing, search and the fit estimate run on the worker's thread between requests (a cache scan,
one Hub call, a config.json). A download runs on its own thread so chatting goes on meanwhile; it
reports through the worker's `send` (which holds a lock: two threads send now) and stops at its
next chunk once `CancelDownload` sets its Event. Nothing a download does can stop the worker: every
failure becomes an `Error` event.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from engine import protocol as p
from engine.errors import MoEScopeError

# huggingface_hub reads a plain-HTTP download in 10 MiB chunks, and the cancel flag is checked
# between chunks; 1 MiB chunks make the bar move smoothly and Cancel answer within a MiB.
CHUNK_BYTES = 1024**2
JOIN_S = 5.0  # how long closing waits for a cancelled download to stop


class DownloadBusy(MoEScopeError):
    kind = "download-busy"


@dataclass
class _Download:
    repo_id: str
    cancel: threading.Event
    thread: threading.Thread


class LibraryService:
    def __init__(self, send: Callable[[object], None]) -> None:
        self.send = send
        self._download: _Download | None = None
        self._lock = threading.Lock()  # guards _download between the worker thread and the download thread

    def handle(self, command) -> None:
        """Run one library command; raises MoEScopeError for the worker to report."""
        if isinstance(command, p.ListLibrary):
            self.send(p.LibraryListing(list_library()))
        elif isinstance(command, p.SearchLibrary):
            self.send(p.LibraryListing(search_library(command.text, command.limit), query=command.text))
        elif isinstance(command, p.EstimateModel):
            self.send(estimate_model(command.repo_id))
        elif isinstance(command, p.DownloadModel):
            self.start_download(command.repo_id, command.quant)
        elif isinstance(command, p.CancelDownload):
            self.cancel_download(command.repo_id)
        else:
            raise TypeError(f"not a library command: {command!r}")

    # ----- download -----
    @property
    def downloading(self) -> str | None:
        with self._lock:
            return self._download.repo_id if self._download is not None else None

    def start_download(self, repo_id: str, quant: str = "") -> None:
        from engine.hub.remote import check_repo_id

        check_repo_id(repo_id)
        with self._lock:
            if self._download is not None:
                raise DownloadBusy(f"'{self._download.repo_id}' is still downloading; wait for it to finish or "
                                   f"cancel it before downloading '{repo_id}'")
            cancel = threading.Event()
            thread = threading.Thread(target=self._run_download, args=(repo_id, quant, cancel), name="moescope-download",
                                      daemon=True)  # never keeps a closing engine alive
            self._download = _Download(repo_id, cancel, thread)
        thread.start()

    def cancel_download(self, repo_id: str | None = None) -> None:
        with self._lock:
            current = self._download
        if current is None or (repo_id is not None and repo_id.lower() != current.repo_id.lower()):
            return  # nothing (or something else) downloading: nothing to stop, as with Cancel
        current.cancel.set()
        self._send(p.DownloadProgress(current.repo_id, 0, 0, 0.0, None, "cancelling…", cancelling=True))

    def close(self) -> None:
        """Stop a download in flight (the engine is shutting down); finished files stay in the cache."""
        with self._lock:
            current = self._download
        if current is not None:
            current.cancel.set()
            current.thread.join(JOIN_S)

    def _run_download(self, repo_id: str, quant: str, cancel: threading.Event) -> None:
        request_id = p.library_request_id("download", repo_id)
        try:
            path = _download(repo_id, quant, cancel, self._send)
            event: object = p.DownloadFinished(repo_id, str(path))
        except MoEScopeError as exc:
            event = p.Error(exc.kind, str(exc), True, request_id)
        except Exception as exc:  # a bug must not pass silently, nor end the worker
            self._send(p.Log("error", traceback.format_exc()))
            event = p.Error("internal", f"the download of '{repo_id}' failed: {type(exc).__name__}: {exc}", True,
                            request_id)
        finally:
            with self._lock:
                self._download = None  # free before the last event: the GUI may start the next one at once
        self._send(event)

    def _send(self, event) -> None:
        with contextlib.suppress(OSError, EOFError, ValueError):  # the GUI went away: nobody to tell
            self.send(event)


# ----------------------------------------------------------------------------- the work


def list_library() -> list[p.LibraryEntry]:
    """Catalog entries (with their cache state), then runnable cached models not in the catalog, then the
    MoE models LM Studio and Ollama downloaded, each with its verdict (their headers are read here)."""
    from engine.hub.catalog import load_catalog
    from engine.hub.local import list_cached_models
    from engine.hub.machine import probe_machine
    from engine.hub.paths import hub_cache_dir

    cached = {m.repo_id.lower(): m for m in list_cached_models(include_all=True)}
    entries = []
    for item in load_catalog():
        entry = p.LibraryEntry(item.repo_id, item.description, "catalog")
        local = cached.pop(item.repo_id.lower(), None)
        if local is not None:
            _mark_cached(entry, local)
        entries.append(entry)
    for local in cached.values():
        if local.runnable and not local.gguf_files:
            entries.append(_mark_cached(p.LibraryEntry(local.repo_id, "in the Hugging Face cache", "cache"), local))
    found = found_models(list(cached.values()))
    if not found:
        return entries
    machine = probe_machine(hub_cache_dir())
    return entries + [_found_entry(model, machine) for model in found]


def found_models(cached: list) -> list:
    """Model files to open where they lie: GGUF files in the HF cache (one per quant file), then LM Studio's
    and Ollama's MoE models (dense ones left out). The same entries `--model NAME` resolves."""
    from engine.hub.local import found_models as every_found

    return [m for m in every_found(cached) if m.moe]


def _found_entry(model, machine) -> p.LibraryEntry:
    from engine.hub.fit import assess
    from engine.hub.found import SOURCES

    where = "in the Hugging Face cache" if model.source == "cache" else f"downloaded by {SOURCES[model.source]}"
    entry = p.LibraryEntry(str(model.path), where, model.source,
                           downloaded=True, local_path=str(model.path) if model.estimate else None,
                           size_bytes=model.size_bytes, problem=model.problem, title=model.name, quant=model.quant)
    if model.estimate is not None:
        entry.model_type = model.estimate.model_type
        entry.params = model.estimate.total_params
        verdict = assess(model.estimate, machine)
        entry.fit_kind, entry.fit_headline = verdict.kind, verdict.headline
    else:
        entry.fit_kind, entry.fit_headline = "unsupported", f"cannot run yet: {model.problem}"
    return entry


def search_library(text: str, limit: int = 30) -> list[p.LibraryEntry]:
    """Hub search results; a typed org/name id the search does not return comes first, unchecked
    (its estimate says whether it exists)."""
    from engine.hub.local import list_cached_models
    from engine.hub.remote import REPO_ID, search_models

    text = text.strip()
    hits = search_models(text, limit=limit) if text else []
    cached = {m.repo_id.lower(): m for m in list_cached_models(include_all=True)}
    entries = []
    if REPO_ID.match(text) and text.lower() not in {h.repo_id.lower() for h in hits}:
        entries.append(p.LibraryEntry(text, "a Hub id: select it to look it up", "search"))
    for hit in hits:
        problem = None
        if hit.quantization and not hit.gguf:
            problem = f"{hit.quantization} quantized weights are not supported by MoEScope yet"
        what = f"{hit.model_type} GGUF on the Hub: pick a quant file" if hit.gguf else f"{hit.model_type} on the Hub"
        entries.append(p.LibraryEntry(hit.repo_id, what, "search", params=hit.params, model_type=hit.model_type,
                                      downloads=hit.downloads, gated=hit.gated, problem=problem,
                                      quant="GGUF" if hit.gguf else ""))
    for entry in entries:
        if (local := cached.get(entry.repo_id.lower())) is not None:
            _mark_cached(entry, local)
    return entries


def _mark_cached(entry: p.LibraryEntry, local) -> p.LibraryEntry:
    from engine.hub.supported import checkpoint_quant

    entry.size_bytes = local.size_on_disk
    if local.gguf_files:  # a GGUF repo: its quant files are entries of their own; the repo stays to pick more
        return entry
    entry.quant = checkpoint_quant(local.config or {})
    entry.model_type = str((local.config or {}).get("model_type") or entry.model_type)
    entry.downloaded = local.complete
    entry.partial = not local.complete
    entry.local_path = str(local.snapshot) if local.complete else None
    if local.problem and local.complete:  # an incomplete copy is fixed by downloading, not a problem
        entry.problem = local.problem
    return entry


def estimate_model(repo_id: str) -> p.FitEstimateReady:
    """The fit verdict (engine.hub.fit.fit_model, as `moescope models info` shows it) as an event."""
    from engine.hub.fit import fit_model, format_summary

    fit = fit_model(repo_id)
    est, verdict = fit.estimate, fit.verdict
    formats = fit.formats
    return p.FitEstimateReady(
        repo_id=repo_id, kind=verdict.kind, headline=verdict.headline, budget=verdict.budget_arg,
        budget_bytes=verdict.budget_bytes, total_bytes=est.dense_bytes + est.all_expert_bytes,
        dense_bytes=est.dense_bytes, expert_bytes=est.all_expert_bytes, min_budget_bytes=est.min_budget_bytes,
        num_experts=est.num_experts, num_moe_layers=est.num_moe_layers, top_k=est.top_k,
        total_params=est.total_params, active_params=est.active_params, dtype=est.dtype,
        download_bytes=fit.missing_bytes, downloaded=fit.local_path is not None,
        local_path=str(fit.local_path) if fit.local_path else None, gated=fit.gated, notes=fit.notes,
        formats=[p.FormatFit(f.format, f.verdict.kind, f.verdict.headline, f.verdict.budget_arg, f.verdict.budget_bytes,
                             f.estimate.all_expert_bytes, f.estimate.min_budget_bytes) for f in formats],
        format_summary=format_summary(formats),
        quants=[p.QuantFit(q.label, q.files, q.size, q.verdict.kind, q.verdict.headline, q.verdict.budget_arg,
                           str(q.local_path) if q.local_path else None) for q in fit.quants],
        quant=fit.quant,
    )


def _download(repo_id: str, quant: str, cancel: threading.Event, send: Callable[[object], None]):
    """Look the repo up, refuse what the engine cannot run, fetch it (a GGUF repo: the one quant file
    set picked); returns the snapshot folder, or the GGUF file to open."""
    from huggingface_hub import constants

    from engine.hub.download import download_model
    from engine.hub.errors import HubError
    from engine.hub.remote import fetch_remote
    from engine.hub.remote_gguf import pick_choice
    from engine.hub.supported import config_problem

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)
    send(p.DownloadProgress(repo_id, 0, 0, 0.0, None, f"looking up {repo_id}…"))
    remote = fetch_remote(repo_id)
    if remote.gguf_files:
        remote.files = pick_choice(remote, quant).files
    # config_problem only (no meta-model estimate here: that patches torch globally, unsafe beside a load)
    elif problem := config_problem(remote.config):
        raise HubError(f"MoEScope cannot run '{repo_id}' ({problem}), so it is not downloaded")

    def on_progress(progress) -> None:
        send(p.DownloadProgress(repo_id, progress.bytes_done, progress.bytes_total, progress.bytes_per_s,
                                progress.eta_s, progress.message, progress.files_done, progress.files_total))

    return download_model(repo_id, remote=remote, on_progress=on_progress, cancel=cancel)
