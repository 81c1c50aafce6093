"""The curated model list shipped in resources/catalog.json: Hub ids and one-line descriptions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MoEScopeError


@dataclass(frozen=True)
class CatalogEntry:
    repo_id: str
    description: str


def catalog_path() -> Path:
    from resources import RESOURCES_DIR

    return RESOURCES_DIR / "catalog.json"


def load_catalog(path: Path | None = None) -> list[CatalogEntry]:
    path = path or catalog_path()
    try:
        data = json.loads(path.read_text())
        return [CatalogEntry(m["repo"], m["description"]) for m in data["models"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise MoEScopeError(f"the model catalog {path} is unreadable ({exc}); reinstall MoEScope") from None
