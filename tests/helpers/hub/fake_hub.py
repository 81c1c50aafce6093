"""A local stand-in for huggingface.co: the few endpoints huggingface_hub's downloads use.

Bound to 127.0.0.1 on a random port; it stops when the test ends (context manager) or, at the
latest, after `lifetime_s`. It answers as the real Hub does (see huggingface_hub/file_download.py):

- GET /api/models?search=...                      search results (id, config, downloads, gated, safetensors, gguf)
- GET /api/models/{repo}[/revision/{rev}]         repo info: sha, gated, siblings (sizes, blob ids, LFS sha256)
- HEAD|GET /{repo}/resolve/{rev}/{file}          X-Repo-Commit, ETag / X-Linked-Etag, Content-Length /
                                                  X-Linked-Size, Accept-Ranges; Range -> 206 + Content-Range
- errors with the Hub's X-Error-Code header: RepoNotFound (404), GatedRepo (401), EntryNotFound (404).

`drop_once` makes the first full GET of a file stop halfway and close the connection.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class FakeFile:
    name: str
    content: bytes | None  # None: listed with `size` but never served (for look-ups and disk checks)
    size: int

    @property
    def is_lfs(self) -> bool:
        return self.name.endswith(LFS_SUFFIXES)

    @property
    def etag(self) -> str:
        if self.content is None:
            return hashlib.sha256(f"{self.name}:{self.size}".encode()).hexdigest()
        if self.is_lfs:
            return hashlib.sha256(self.content).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()  # git blob id


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, FakeFile]
    sha: str = field(default_factory=lambda: uuid.uuid4().hex + uuid.uuid4().hex[:8])
    gated: bool = False
    downloads: int = 0
    gguf: dict | None = None  # the Hub's GGUF summary of a GGUF repo: {"architecture": ..., "total": ...}

    @property
    def config(self) -> dict:
        f = self.files.get("config.json")
        return json.loads(f.content) if f is not None and f.content is not None else {}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None


class FakeHub:
    def __init__(self, *, lifetime_s: float = 300.0) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.drop_once: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.watchdog = threading.Timer(lifetime_s, self.stop)
        self.watchdog.daemon = True
        self.stopped = False

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        self.watchdog.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        self.watchdog.cancel()
        self.server.shutdown()
        self.server.server_close()

    # ----- content
    def add_repo(self, repo_id: str, files: dict[str, bytes | int], **kwargs) -> FakeRepo:
        entries = {
            name: FakeFile(name, None, data) if isinstance(data, int) else FakeFile(name, data, len(data))
            for name, data in files.items()
        }
        repo = FakeRepo(repo_id, entries, **kwargs)
        self.repos[repo_id] = repo
        return repo

    def add_folder(self, repo_id: str, folder: Path, *, extra: dict[str, bytes | int] | None = None, **kwargs) -> FakeRepo:
        files: dict[str, bytes | int] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        files.update(extra or {})
        return self.add_repo(repo_id, files, **kwargs)

    def gets(self, suffix: str = "") -> list[Request]:
        """The GET requests for files (not API calls) whose path ends with `suffix`."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(suffix)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:  # quiet test output
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # ----- routing
    def _route(self, *, body: bool) -> None:
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parse_qs(parts.query)
        with self.hub.lock:
            self.hub.requests.append(Request(self.command, path, self.headers.get("Range")))
        if path == "/api/models":
            return self._search(query)
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?", path)
        if match:
            return self._repo_info(match.group(1), "blobs" in query)
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if match:
            return self._resolve(*match.groups(), body=body)
        self._error(404, "Not found", {})

    def _search(self, query: dict) -> None:
        text = (query.get("search") or [""])[0].lower()
        limit = int((query.get("limit") or ["1000"])[0])
        hits = [r for r in self.hub.repos.values() if text in r.repo_id.lower()]
        hits.sort(key=lambda r: -r.downloads)
        self._json([
            {"id": r.repo_id, "config": {k: r.config.get(k) for k in ("model_type", "architectures", "quantization_config") if k in r.config},
             "downloads": r.downloads, "gated": "manual" if r.gated else False,
             "safetensors": {"parameters": {"F32": self._params(r)}, "total": self._params(r)},
             **({"gguf": r.gguf} if r.gguf else {})}
            for r in hits[:limit]
        ])

    def _params(self, repo: FakeRepo) -> int:
        return sum(f.size for f in repo.files.values() if f.name.endswith(".safetensors")) // 4

    def _repo_info(self, repo_id: str, blobs: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
        siblings = []
        for f in repo.files.values():
            entry: dict = {"rfilename": f.name}
            if blobs:
                entry.update(size=f.size, blobId=hashlib.sha1(f.name.encode()).hexdigest())
                if f.is_lfs:
                    entry["lfs"] = {"size": f.size, "sha256": f.etag, "pointerSize": 134}
                else:
                    entry["blobId"] = f.etag
            siblings.append(entry)
        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False, "downloads": repo.downloads,
                    "tags": [], "siblings": siblings, "config": repo.config})

    def _resolve(self, repo_id: str, revision: str, filename: str, *, body: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
        if repo.gated:
            return self._error(401, "Access to this model is restricted", {
                "X-Error-Code": "GatedRepo",
                "X-Error-Message": f"Access to model {repo_id} is restricted. You must have access to it and be "
                                   "authenticated to access it. Please log in.",
            })
        if revision not in ("main", repo.sha):
            return self._error(404, "Revision not found", {"X-Error-Code": "RevisionNotFound"})
        f = repo.files.get(filename)
        if f is None:
            return self._error(404, "Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
        if f.content is None:  # listed for look-ups only; never downloaded in tests
            return self._error(404, "Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if f.is_lfs:
            headers.update({"X-Linked-Etag": f'"{f.etag}"', "X-Linked-Size": str(f.size)})
        start, status = 0, 200
        requested = self.headers.get("Range") if body else None
        if requested:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", requested)
            if not match or int(match.group(1)) >= f.size:
                return self._error(416, "Range not satisfiable", {"Content-Range": f"bytes */{f.size}"})
            start, status = int(match.group(1)), 206
            end = int(match.group(2)) if match.group(2) else f.size - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
            data = f.content[start:end + 1]
        else:
            data = f.content
        headers["Content-Length"] = str(len(data))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not body:
            return
        key = (repo_id, filename)
        with self.hub.lock:
            drop = not requested and key in self.hub.drop_once
            self.hub.drop_once.discard(key)
        if drop:  # half the body, then the connection goes away: a network cut mid-download
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    # ----- helpers
    def _json(self, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict[str, str]) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
