"""Reading a model's facts from the Hub: its files and sizes, its config.json, search results.

Only metadata and small JSON files travel here; config.json goes into the HF cache, as
transformers would put it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.hub.errors import HubError, translate
from engine.hub.paths import hub_cache_dir, hub_endpoint
from engine.hub.supported import quantization_of, supported_model_types

INDEX_FILE = "model.safetensors.index.json"
# What the engine needs: weights, config, generation config, tokenizer and chat template. Nothing else
# (no pickles, no ONNX/GGUF copies, no sub-folders such as gpt-oss's original/).
ALLOW_PATTERNS = [
    "*.safetensors", INDEX_FILE, "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "chat_template.json",
    "chat_template.jinja",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    blob: str | None  # the file's name under blobs/ in the cache: LFS sha256, or git blob id


@dataclass
class RemoteModel:
    repo_id: str
    sha: str
    gated: bool
    files: list[RemoteFile]  # the files a download fetches
    config: dict
    notes: list[str] = field(default_factory=list)
    gguf_files: list[RemoteFile] = field(default_factory=list)  # a GGUF repo's .gguf files (engine.hub.remote_gguf)

    @property
    def weight_bytes(self) -> int | None:
        sizes = [f.size for f in self.files if f.name.endswith(".safetensors")]
        return None if not sizes or None in sizes else sum(sizes)  # type: ignore[arg-type]

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass(frozen=True)
class SearchHit:
    repo_id: str
    model_type: str
    params: int | None  # from the Hub's safetensors summary
    downloads: int
    gated: bool
    quantization: str | None
    gguf: bool = False  # a GGUF repo: one file (or split set) per quant type to pick from


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id):
        raise HubError(f"'{repo_id}' is neither a folder here nor a Hub model id; write Hub ids as org/name, e.g. Qwen/Qwen3-30B-A3B")


def fetch_remote(
    repo_id: str, *, revision: str = "main", endpoint: str | None = None, token: str | bool | None = None,
    cache_dir: Path | None = None,
) -> RemoteModel:
    """The repo's commit, the files a download would fetch (with sizes) and its config.json."""
    from huggingface_hub import HfApi, hf_hub_download

    check_repo_id(repo_id)
    endpoint = endpoint or hub_endpoint()
    cache_dir = cache_dir or hub_cache_dir()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        ggufs = [_remote_file(s) for name, s in siblings.items() if name.lower().endswith(".gguf")]
        if "config.json" not in siblings and ggufs:  # a GGUF repo: the user picks a quant file
            return RemoteModel(repo_id, str(info.sha), bool(info.gated), [], {}, gguf_files=ggufs)
        if "config.json" not in siblings:
            raise HubError(f"'{repo_id}' has no config.json and no GGUF files; it is not a model MoEScope can run")

        def fetch_json(name: str) -> dict:
            path = hf_hub_download(repo_id, name, revision=info.sha, cache_dir=cache_dir, endpoint=endpoint, token=token)
            return json.loads(Path(path).read_text())

        config = fetch_json("config.json")
        index = fetch_json(INDEX_FILE) if INDEX_FILE in siblings else None
    except Exception as exc:
        raise translate(exc, repo_id, endpoint=endpoint, what="look-up") from None
    files = [_remote_file(s) for s in siblings.values() if s.rfilename in select_files(list(siblings), index)]
    model = RemoteModel(repo_id, str(info.sha), bool(info.gated), files, config)
    if not any(f.name.endswith(".safetensors") for f in files):
        model.notes.append("the repo has no safetensors weights at its top level; MoEScope cannot download it")
    return model


def _remote_file(sibling) -> RemoteFile:
    lfs = sibling.lfs
    return RemoteFile(sibling.rfilename, lfs.size if lfs else sibling.size, lfs.sha256 if lfs else sibling.blob_id)


def select_files(names: list[str], index: dict | None) -> list[str]:
    """The top-level files a download fetches. With an index, only the shards it names: repos that
    also ship a consolidated copy (Mistral's consolidated.safetensors) would otherwise be fetched twice."""
    from huggingface_hub.utils import filter_repo_objects

    chosen = [n for n in filter_repo_objects(names, allow_patterns=ALLOW_PATTERNS) if "/" not in n]
    if index is not None:
        shards = set(index.get("weight_map", {}).values())
        chosen = [n for n in chosen if not n.endswith(".safetensors") or n in shards]
    # small files first: a stopped download already holds config and tokenizer
    return sorted(chosen, key=lambda n: (n.endswith(".safetensors"), n))


def search_models(
    text: str, *, limit: int = 20, endpoint: str | None = None, token: str | bool | None = None, scan: int = 200,
) -> list[SearchHit]:
    """Hub text search, most downloaded first, keeping model types the engine runs offloaded (checkpoints
    and GGUF repos)."""
    from huggingface_hub import HfApi

    from engine.hub.gguf_info import GGUF_ARCHITECTURES, searchable_gguf

    endpoint = endpoint or hub_endpoint()
    supported = supported_model_types()
    hits: list[SearchHit] = []
    try:
        _reachable(endpoint)
        api = HfApi(endpoint=endpoint, token=token)
        for info in api.list_models(search=text, sort="downloads", limit=scan,
                                    expand=["config", "safetensors", "downloads", "gguf", "gated"]):
            config = info.config or {}
            arch = str((info.gguf or {}).get("architecture") or "")
            if config.get("model_type") in supported:
                params = info.safetensors.total if info.safetensors else None
                hits.append(SearchHit(info.id, config["model_type"], params, info.downloads or 0, bool(info.gated),
                                      quantization_of(config)))
            elif arch and searchable_gguf(arch, info.id):
                hits.append(SearchHit(info.id, GGUF_ARCHITECTURES[arch], (info.gguf or {}).get("total"),
                                      info.downloads or 0, bool(info.gated), "GGUF", gguf=True))
            else:
                continue
            if len(hits) >= limit:
                break
    except Exception as exc:
        raise translate(exc, text, endpoint=endpoint, what="search") from None
    return hits


PROBE_TIMEOUT_S = 10.0  # huggingface_hub's own for a metadata request


def _reachable(endpoint: str) -> None:
    """One request, without retries, before a listing: huggingface_hub retries a listing that cannot
    connect 5 times with backoff (about 28 s) before the error. Offline mode is left to huggingface_hub,
    which refuses at once; any HTTP answer means the endpoint is there."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if not constants.is_offline_mode():
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)  # its transport errors: NetworkError's one line
