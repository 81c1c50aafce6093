"""Models on this machine: the Hugging Face cache (shared with other tools) and plain folders."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import MODEL_ACCEPTS, CheckpointError
from engine.hub.errors import HubError
from engine.hub.paths import hub_cache_dir
from engine.hub.remote import INDEX_FILE, REPO_ID
from engine.hub.supported import config_problem


@dataclass
class CachedModel:
    repo_id: str
    snapshot: Path
    commit: str
    refs: list[str]
    size_on_disk: int
    config: dict | None
    complete: bool  # every weight file the index names is there
    problem: str | None  # why the engine cannot run it, None when it can
    gguf_files: list[Path] = field(default_factory=list)  # a GGUF repo's model files here (split sets by part 1)

    @property
    def runnable(self) -> bool:
        return self.problem is None


def list_cached_models(cache_dir: Path | None = None, *, include_all: bool = False) -> list[CachedModel]:
    """Model repos in the HF cache; by default only those the engine can run."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache_dir = cache_dir or hub_cache_dir()
    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, ValueError):  # no cache yet, or a file where the cache should be
        return []
    models = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        # the revision `main` points at, else the newest one
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        model = _describe(repo.repo_id, revision.snapshot_path, revision.commit_hash, sorted(revision.refs),
                          revision.size_on_disk)
        if include_all or model.runnable:
            models.append(model)
    return models


def find_cached(repo_id: str, cache_dir: Path | None = None) -> CachedModel | None:
    for model in list_cached_models(cache_dir, include_all=True):
        if model.repo_id.lower() == repo_id.lower():
            return model
    return None


def resolve_model(ref: str, cache_dir: Path | None = None) -> Path:
    """What a model reference names: 'demo', a path, a Hub id already downloaded (org/name), or a name
    the library lists (an Ollama `qwen3:30b`, an LM Studio `publisher/repo/file.gguf`, a GGUF in the
    cache). A path that does not exist is returned as it is, for the loader to say so."""
    if ref == "demo":
        from resources import DEMO_MODEL_DIR

        return DEMO_MODEL_DIR
    path = Path(ref).expanduser()
    if path.exists() or path.is_absolute():
        return path
    if REPO_ID.match(ref):
        cached = find_cached(ref, cache_dir)
        if cached is not None and len(cached.gguf_files) == 1:
            return cached.gguf_files[0]
        if cached is not None and cached.gguf_files:
            names = ", ".join(str(f.relative_to(cached.snapshot)) for f in cached.gguf_files)
            raise CheckpointError(f"'{ref}' holds several GGUF files; pass the path of the one to open ({names} "
                                  f"in {cached.snapshot})")
        if cached is not None and cached.complete:
            return cached.snapshot
    if (named := find_named(ref, cache_dir)) is not None:  # LM Studio's org/repo folders match REPO_ID too
        return named
    if REPO_ID.match(ref):
        raise CheckpointError(f"'{ref}' is not downloaded yet; get it with `moescope models download {ref}`")
    raise CheckpointError(f"model path '{ref}' does not exist; pass {MODEL_ACCEPTS}")


def found_models(cached: list[CachedModel]) -> list:
    """Model files opened where they lie, as the library names them: GGUF files in the HF cache (one per
    quant file), then LM Studio's and Ollama's models (dense ones too: `FoundModel.moe` says)."""
    from engine.hub.found import describe_gguf
    from engine.hub.lmstudio import list_lmstudio
    from engine.hub.ollama import list_ollama

    ggufs = [describe_gguf("cache", f"{local.repo_id}/{f.relative_to(local.snapshot)}", f)
             for local in cached for f in local.gguf_files]
    return ggufs + list_lmstudio() + list_ollama()


def find_named(ref: str, cache_dir: Path | None = None) -> Path | None:
    """The file or folder of the library entry named `ref` (`qwen3` is Ollama's `qwen3:latest`), None
    when no entry has that name; an entry that cannot be opened raises its own line."""
    wanted = {ref.lower(), f"{ref.lower()}:latest"} if ":" not in ref else {ref.lower()}
    for model in found_models(list_cached_models(cache_dir, include_all=True)):
        if model.name.lower() in wanted:
            if model.estimate is None and model.problem:  # a broken manifest, a missing blob or part
                raise CheckpointError(model.problem)
            return model.path
    return None


def remove_cached(repo_id: str, cache_dir: Path | None = None, *, execute: bool = False) -> int:
    """Delete every cached revision of `repo_id` through huggingface_hub; returns the bytes freed
    (or that would be freed when `execute` is False). Blobs shared with other repos are kept."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache_dir = cache_dir or hub_cache_dir()
    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, ValueError):
        info = None
    repo = next((r for r in (info.repos if info else ()) if r.repo_type == "model"
                 and r.repo_id.lower() == repo_id.lower()), None)
    if info is None or repo is None:
        raise HubError(f"'{repo_id}' is not in the Hugging Face cache at {cache_dir}; see `moescope models list`")
    strategy = info.delete_revisions(*[r.commit_hash for r in repo.revisions])
    if execute:
        strategy.execute()
    return strategy.expected_freed_size


def _describe(repo_id: str, snapshot: Path, commit: str, refs: list[str], size: int) -> CachedModel:
    config = None
    config_path = snapshot / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            config = None
    complete = _weights_complete(snapshot)
    if config is None and (ggufs := cached_ggufs(snapshot)):  # one entry per quant file (engine.hub.found)
        return CachedModel(repo_id, snapshot, commit, refs, size, None, True, None, ggufs)
    problem = "no readable config.json" if config is None else config_problem(config)
    if problem is None and not any(snapshot.glob("*.safetensors")):
        problem = "no safetensors weights downloaded"
    elif problem is None and not complete:
        problem = "download incomplete: run `moescope models download` again"
    return CachedModel(repo_id, snapshot, commit, refs, size, config, complete, problem)


def cached_ggufs(snapshot: Path) -> list[Path]:
    """The GGUF model files of a snapshot, in sub-folders too (repos keep a folder per quant)."""
    from engine.hub.lmstudio import model_files

    folders = sorted({p.parent for p in snapshot.rglob("*.gguf")})
    return [f for folder in folders for f in model_files(folder) if f.exists()]  # exists(): skips broken links


def _weights_complete(snapshot: Path) -> bool:
    index = snapshot / INDEX_FILE
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return False
        return bool(shards) and all((snapshot / s).exists() for s in shards)
    return any(p.exists() for p in snapshot.glob("*.safetensors"))
