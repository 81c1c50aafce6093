"""The fake Hub and HF cache the model library's tests give a spawned engine worker.

(No tests here: helpers shared by tests/test_library_worker.py and tests/test_app_library.py.)

`HoldingHub` can hold a file mid-body until the test releases it, so a download is "in flight" for
exactly as long as a test needs (to cancel it, to chat beside it) with no timing guesswork.
`hub_environment` sets what the worker reads at start (HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_HUB_DOWNLOAD_TIMEOUT): the worker is a spawned process, so they must be in os.environ before it
starts; they are restored after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from engine.hub.paths import repo_folder
from tests.helpers.hub.fake_hub import FakeHub, _Handler

FIXTURES = Path(__file__).parent
SHA = "0123456789abcdef0123456789abcdef01234567"
HOLD_AFTER = 2 * 1024**2 + 1024  # > two of the worker's 1 MiB download chunks, so progress is under way
HOLD_TIMEOUT_S = 300  # the worker's read timeout: longer than any test holds a body


class HoldingHub(FakeHub):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hold: set[tuple[str, str]] = set()  # (repo, file) whose body stops after HOLD_AFTER bytes
        self.held = threading.Event()  # a held body reached the hold point
        self.release = threading.Event()  # the rest of a held body may go
        self.server.RequestHandlerClass = _HoldingHandler
        self.server.handle_error = lambda request, address: None  # a cancelled download hangs up mid-body

    def hold_file(self, repo_id: str, filename: str) -> None:
        self.hold.add((repo_id, filename))
        self.held, self.release = threading.Event(), threading.Event()

    def stop(self) -> None:
        self.release.set()  # no handler thread waits past the test
        super().stop()


class _HoldingHandler(_Handler):
    current: tuple[str, str] | None = None

    def setup(self) -> None:
        super().setup()
        self.wfile = _HoldingWriter(self.wfile, self)

    def _resolve(self, repo_id: str, revision: str, filename: str, *, body: bool) -> None:
        self.current = (repo_id, filename)
        try:
            super()._resolve(repo_id, revision, filename, body=body)
        finally:
            self.current = None


class _HoldingWriter:
    def __init__(self, inner, handler: _HoldingHandler) -> None:
        self.inner, self.handler = inner, handler

    def write(self, data: bytes) -> int:
        hub: HoldingHub = self.handler.hub  # type: ignore[assignment]
        if self.handler.current in hub.hold and len(data) > HOLD_AFTER:
            self.inner.write(data[:HOLD_AFTER])
            self.inner.flush()
            hub.held.set()
            hub.release.wait(HOLD_TIMEOUT_S)
            return self.inner.write(data[HOLD_AFTER:]) + HOLD_AFTER
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def place_in_cache(cache: Path, repo_id: str, folder: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """Lay `folder` out as huggingface_hub does: blobs/<hash>, snapshots/<sha>/<file> -> blob, refs/main."""
    repo = repo_folder(cache, repo_id)
    snapshot, blobs = repo / "snapshots" / SHA, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(folder.iterdir()):
        if f.name in skip:
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


@contextlib.contextmanager
def hub_environment(endpoint: str, cache: Path) -> Iterator[None]:
    """What a worker started inside the block sees: this Hub, this cache, online, patient."""
    names = ("HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_HUB_DOWNLOAD_TIMEOUT")
    saved = {name: os.environ.get(name) for name in names}
    # huggingface_hub gives up on a silent body after 10 s and resumes with a Range request the hold
    # does not catch: on a loaded machine a held download then finished before the test's Cancel.
    os.environ.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="0",
                      HF_HUB_DOWNLOAD_TIMEOUT=str(HOLD_TIMEOUT_S))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def padding_weights(nbytes: int = 4 * 1024**2) -> bytes:
    """A valid safetensors file of about `nbytes` (a download's header check reads it)."""
    import numpy as np
    from safetensors.numpy import save

    return save({"padding": np.zeros(nbytes // 4, dtype=np.float32)})


def fill_hub(hub: HoldingHub, checkpoint: Path) -> dict[str, str]:
    """The repos the library tests use; returns their ids by role."""
    ids = {"tiny": "moescope-test/tiny-mixtral", "slow": "moescope-test/slow-mixtral", "qwen": "Qwen/Qwen3-30B-A3B"}
    hub.add_folder(ids["tiny"], checkpoint, downloads=10)
    config = (checkpoint / "config.json").read_bytes()
    # weights the Hub holds back until released: the download stays in flight
    hub.add_repo(ids["slow"], {"config.json": config, "model.safetensors": padding_weights()}, downloads=5)
    hub.hold_file(ids["slow"], "model.safetensors")
    hub.add_repo(ids["qwen"], {"config.json": (FIXTURES / "qwen3-30b-a3b.json").read_bytes(),
                               "model-00001-of-00001.safetensors": 61_064_245_248})
    return ids
