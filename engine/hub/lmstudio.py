"""LM Studio's downloaded models: `<models folder>/<publisher>/<repo>/` holding GGUF files (or an
MLX/safetensors checkpoint folder).

The models folder is `~/.lmstudio/models` unless LM Studio's settings (`~/.lmstudio/settings.json`,
`downloadsFolder`) name another; `~/.lmstudio-home-pointer` moves LM Studio's home itself, and
older versions kept models in `~/.cache/lm-studio/models`. Only read, never written.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.hub.found import FoundModel, describe_folder, describe_gguf
from engine.model.gguf.file import SPLIT_NAME


def lmstudio_home() -> Path:
    pointer = Path.home() / ".lmstudio-home-pointer"
    try:
        named = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    return Path(named).expanduser() if named else Path.home() / ".lmstudio"


def lmstudio_model_dirs() -> list[Path]:
    """Every models folder LM Studio may use here that exists: the settings' one first."""
    home = lmstudio_home()
    candidates = []
    try:
        settings = json.loads((home / "settings.json").read_text())
        if isinstance(settings, dict) and isinstance(settings.get("downloadsFolder"), str):
            candidates.append(Path(settings["downloadsFolder"]).expanduser())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass  # no settings (never changed) or unreadable: the defaults below
    candidates += [home / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    found: list[Path] = []
    for folder in candidates:
        if folder.is_dir() and not any(_same(folder, f) for f in found):
            found.append(folder)
    return found


def list_lmstudio() -> list[FoundModel]:
    """One entry per GGUF file (a split set as one, vision projectors left out) or checkpoint folder."""
    models = []
    for root in lmstudio_model_dirs():
        for repo in sorted(p for p in root.glob("*/*") if p.is_dir()):
            name = f"{repo.parent.name}/{repo.name}"
            if (repo / "config.json").is_file() and any(repo.glob("*.safetensors")):
                models.append(describe_folder("lmstudio", name, repo))
            for gguf in model_files(repo):
                models.append(describe_gguf("lmstudio", f"{name}/{gguf.name}", gguf))
    return models


def model_files(folder: Path) -> list[Path]:
    """The GGUF model files of a folder: split sets by their first part, without mmproj projectors."""
    files = []
    for path in sorted(folder.glob("*.gguf")):
        if path.name.lower().startswith("mmproj"):
            continue
        split = SPLIT_NAME.match(path.name)
        if split is not None and int(split["no"]) != 1:
            continue
        files.append(path)
    return files


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
