"""Downloading a model into the standard Hugging Face cache, with progress, cancel and clear errors.

huggingface_hub does the transfer (plain HTTP or Xet), checks sizes and lays the cache out, so
models fetched by other tools are reused and ours are reused by them. Files go one at a time,
small ones first; each `hf_hub_download` gets a stand-in progress bar that counts bytes and checks
the cancel flag between chunks. A dropped connection is resumed by huggingface_hub itself (HTTP
Range); files finished before a stop are kept, so running the download again fetches only the rest.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.accounting.sizes import format_bytes
from engine.errors import CheckpointError
from engine.hub.errors import DiskFullError, DownloadCancelled, HubError, is_disk_full, translate
from engine.hub.machine import disk_free
from engine.hub.paths import hub_cache_dir, hub_endpoint, repo_folder
from engine.hub.remote import RemoteFile, RemoteModel, fetch_remote


@dataclass(frozen=True)
class DownloadProgress:
    """One progress report; the GUI turns it into a `LoadProgress` event."""

    repo_id: str
    filename: str  # the file in flight
    files_done: int
    files_total: int  # files this download fetches (those already in the cache are not counted)
    bytes_done: int
    bytes_total: int
    bytes_per_s: float
    eta_s: float | None
    finished: bool = False

    @property
    def fraction(self) -> float:
        return 1.0 if self.finished or self.bytes_total <= 0 else min(1.0, self.bytes_done / self.bytes_total)

    @property
    def message(self) -> str:
        if self.finished:
            return f"{self.repo_id}: downloaded {format_bytes(self.bytes_done)}"
        eta = "" if self.eta_s is None else f", {format_eta(self.eta_s)} left"
        return (f"{self.filename}: {format_bytes(self.bytes_done)} of {format_bytes(self.bytes_total)} at "
                f"{format_bytes(self.bytes_per_s)}/s{eta}")

    def to_load_progress(self):
        from engine.protocol import LoadProgress

        return LoadProgress(self.fraction, self.message)


ProgressCallback = Callable[[DownloadProgress], None]


@dataclass
class DownloadPlan:
    remote: RemoteModel
    snapshot: Path
    present: list[RemoteFile]  # already in the cache (from an earlier run or another tool)
    missing: list[RemoteFile]

    @property
    def missing_bytes(self) -> int:
        return sum(f.size or 0 for f in self.missing)


def plan_download(remote: RemoteModel, cache_dir: Path) -> DownloadPlan:
    folder = repo_folder(cache_dir, remote.repo_id)
    snapshot = folder / "snapshots" / remote.sha
    present, missing = [], []
    for f in remote.files:
        blob = folder / "blobs" / f.blob if f.blob else None
        in_snapshot = (snapshot / f.name).exists()
        in_blobs = blob is not None and blob.is_file() and (f.size is None or blob.stat().st_size == f.size)
        (present if in_snapshot or in_blobs else missing).append(f)
    return DownloadPlan(remote, snapshot, present, missing)


def download_model(
    repo_id: str,
    *,
    revision: str = "main",
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    free_disk_bytes: int | None = None,  # tests inject a small figure; None measures the disk
    remote: RemoteModel | None = None,  # already fetched (the CLI shows the fit first)
) -> Path:
    """Fetch the model's safetensors, config and tokenizer files; return the snapshot folder."""
    from huggingface_hub import hf_hub_download

    cache_dir = cache_dir or hub_cache_dir()
    endpoint = endpoint or hub_endpoint()
    remote = remote or fetch_remote(repo_id, revision=revision, endpoint=endpoint, token=token, cache_dir=cache_dir)
    if not any(f.name.endswith((".safetensors", ".gguf")) for f in remote.files):
        what = "pick one of its quant files" if remote.gguf_files else "MoEScope downloads safetensors checkpoints"
        raise HubError(f"'{repo_id}' has no safetensors weights to fetch; {what}")
    plan = plan_download(remote, cache_dir)
    free = disk_free(cache_dir) if free_disk_bytes is None else free_disk_bytes
    if plan.missing_bytes > free:
        raise DiskFullError(
            f"not enough disk space for '{repo_id}': the download needs {format_bytes(plan.missing_bytes)}, "
            f"{cache_dir} has {format_bytes(free)} free; free {format_bytes(plan.missing_bytes - free)} "
            "or point HF_HUB_CACHE at a bigger disk"
        )
    tracker = _Tracker(repo_id, len(plan.missing), plan.missing_bytes, on_progress, cancel)
    bar = _bar_class(tracker)
    for number, f in enumerate(plan.missing):
        tracker.start_file(f.name)
        try:
            hf_hub_download(repo_id, f.name, revision=remote.sha, cache_dir=cache_dir, endpoint=endpoint,
                            token=token, tqdm_class=bar)
        except DownloadCancelled:
            raise tracker.cancelled(number) from None
        except Exception as exc:
            if tracker.is_cancelled():  # a Xet transfer aborted by the cancel surfaces as its own error
                raise tracker.cancelled(number) from None
            if is_disk_full(exc):
                raise DiskFullError(
                    f"the disk holding {cache_dir} filled up while downloading {f.name} of '{repo_id}': free at "
                    f"least {format_bytes(plan.missing_bytes - tracker.finished_bytes)} (or point HF_HUB_CACHE at a "
                    "bigger disk) and run the download again; finished files are kept"
                ) from None
            raise translate(exc, repo_id, endpoint=endpoint) from None
        tracker.finish_file(f.size)
    _write_ref(repo_folder(cache_dir, repo_id), revision, remote.sha)
    _verify(repo_id, plan.snapshot, [f.name for f in plan.missing])
    tracker.emit(finished=True)
    ggufs = [f.name for f in remote.files if f.name.endswith(".gguf")]
    return plan.snapshot / sorted(ggufs)[0] if ggufs else plan.snapshot  # a GGUF opens as its (first) file


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Tracker:
    """Counts bytes across files, measures the rate over the last few seconds, reports, and cancels."""

    RATE_WINDOW_S = 5.0
    MIN_INTERVAL_S = 0.1  # at most ~10 reports a second

    def __init__(self, repo_id: str, files_total: int, bytes_total: int,
                 on_progress: ProgressCallback | None, cancel: threading.Event | None) -> None:
        self.repo_id, self.files_total, self.bytes_total = repo_id, files_total, bytes_total
        self.on_progress, self.cancel = on_progress, cancel
        self.files_done = 0
        self.finished_bytes = 0  # of whole files: the count goes back here if a file restarts
        self.bytes_done = 0
        self.filename = ""
        self.lock = threading.Lock()  # Xet reports from its own thread
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        self.last_emit = 0.0
        self.aborted_xet = False

    def start_file(self, name: str) -> None:
        self.check_cancel()
        self.filename = name
        self.emit(force=True)

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n
            now = time.monotonic()
            self.samples.append((now, self.bytes_done))
            while len(self.samples) > 2 and now - self.samples[0][0] > self.RATE_WINDOW_S:
                self.samples.popleft()
        self.emit()

    def finish_file(self, size: int | None) -> None:
        with self.lock:
            self.files_done += 1
            self.finished_bytes = self.finished_bytes + size if size is not None else self.bytes_done
            self.bytes_done = self.finished_bytes  # exact, whatever the transfer reported
        self.emit(force=True)

    def rate(self) -> float:
        with self.lock:
            (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return max(0.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else 0.0

    def emit(self, *, force: bool = False, finished: bool = False) -> None:
        now = time.monotonic()
        if self.on_progress is None or (not force and not finished and now - self.last_emit < self.MIN_INTERVAL_S):
            return
        self.last_emit = now
        rate = self.rate()
        left = max(0, self.bytes_total - self.bytes_done)
        eta = left / rate if rate > 0 else (0.0 if finished else None)
        self.on_progress(DownloadProgress(self.repo_id, "" if finished else self.filename, self.files_done,
                                          self.files_total, self.bytes_done, self.bytes_total, rate, eta, finished))

    def is_cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def check_cancel(self) -> None:
        if not self.is_cancelled():
            return
        if not self.aborted_xet and "hf_xet" in sys.modules:
            # An exception raised inside a Xet progress callback may not stop the Rust transfer; aborting does.
            self.aborted_xet = True
            from huggingface_hub.utils._xet import abort_xet_session

            abort_xet_session()
        raise DownloadCancelled(f"download of '{self.repo_id}' cancelled")

    def cancelled(self, files_done: int) -> DownloadCancelled:
        kept = f"{files_done} of {self.files_total} files were finished and are kept" if files_done else "nothing was kept"
        return DownloadCancelled(f"download of '{self.repo_id}' cancelled: {kept}; download it again to continue")


def _bar_class(tracker: _Tracker) -> type:
    class _Bar:
        """Stands in for tqdm inside huggingface_hub: forwards byte counts, checks for cancel between chunks."""

        def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs) -> None:
            self.total, self.n = total, 0
            if initial:
                self.update(initial)

        def update(self, n: float | None = 1) -> None:
            n = int(n or 0)  # negative when huggingface_hub restarts a file the server would not resume
            self.n += n
            tracker.add(n)
            tracker.check_cancel()

        def update_transfer(self, n: float | None = 1) -> None:
            pass  # bytes over the network (Xet may fetch fewer than it writes); progress counts bytes written

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc) -> None:
            return None

        def close(self) -> None:
            pass

        def refresh(self, *args, **kwargs) -> None:
            pass

        def set_postfix_str(self, *args, **kwargs) -> None:
            pass

        def set_transfer_postfix_str(self, *args, **kwargs) -> None:
            pass

        def set_description(self, *args, **kwargs) -> None:
            pass

        set_description_str = set_description

    return _Bar


def _write_ref(folder: Path, revision: str, sha: str) -> None:
    """refs/<branch> -> commit, as snapshot_download writes it, so offline look-ups by branch find the snapshot."""
    if revision == sha:
        return
    ref = folder / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(sha)
    os.replace(tmp, ref)


def _verify(repo_id: str, snapshot: Path, names: list[str]) -> None:
    """Read every new safetensors header and the GGUF's (every part): a truncated or corrupt file is named
    now, not at load time."""
    from engine.hub.gguf_info import read_header
    from engine.model.checkpoint import read_safetensors_header

    ggufs = sorted(name for name in names if name.endswith(".gguf"))
    try:
        for name in names:
            if name.endswith(".safetensors"):
                read_safetensors_header(snapshot / name)
        if ggufs:
            read_header(snapshot / ggufs[0])
    except CheckpointError as exc:
        raise HubError(f"{exc} (the broken copy stays in the cache until you run "
                       f"`moescope models remove {repo_id} --yes`)") from None
