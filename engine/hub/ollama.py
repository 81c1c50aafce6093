"""Ollama's model store: `manifests/<registry>/<namespace>/<model>/<tag>` JSON manifests whose
`application/vnd.ollama.image.model` layer names the GGUF blob `blobs/sha256-<hex>`.

The store is `~/.ollama/models` unless `OLLAMA_MODELS` names another (as Ollama itself reads it).
Only read, never written: the blob is opened where it lies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.hub.found import FoundModel, describe_gguf

MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"


def ollama_models_dir() -> Path:
    named = os.environ.get("OLLAMA_MODELS")
    return Path(named).expanduser() if named else Path.home() / ".ollama" / "models"


def list_ollama(models: Path | None = None) -> list[FoundModel]:
    """One entry per manifest; a broken manifest or a missing blob is an entry with its problem."""
    models = models or ollama_models_dir()
    manifests = models / "manifests"
    found = []
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        name = model_name(manifest.relative_to(manifests))
        blob, problem = model_blob(models, manifest, name)
        if blob is None:
            found.append(FoundModel("ollama", name, manifest, 0, problem=problem))
        else:
            found.append(describe_gguf("ollama", name, blob))
    return found


def model_name(relative: Path) -> str:
    """How `ollama list` names it: qwen3:30b, user/model:tag, or host/ns/model:tag."""
    registry, namespace, model, tag = relative.parts
    if registry == DEFAULT_REGISTRY:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{registry}/{namespace}/{model}:{tag}"


def model_blob(models: Path, manifest: Path, name: str) -> tuple[Path | None, str | None]:
    """The GGUF blob a manifest points at, or None and one line saying what is wrong."""
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None, f"Ollama manifest {manifest} is not a readable manifest; `ollama pull {name}` again"
    except StopIteration:
        return None, f"Ollama manifest {manifest} names no model layer ({MODEL_LAYER}); `ollama pull {name}` again"
    blob = models / "blobs" / str(digest).replace(":", "-", 1)
    if not blob.is_file():
        return None, f"Ollama's model file {blob.name} for {name} is missing from {blob.parent}; `ollama pull {name}` again"
    return blob, None
