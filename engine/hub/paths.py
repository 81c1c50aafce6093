"""Where the Hugging Face cache and Hub are: the same settings huggingface_hub and other tools use.

Read at call time (huggingface_hub reads them once at import), so a changed HF_HUB_CACHE or
HF_ENDPOINT is honoured; models downloaded by other tools are found in the same cache.
"""

from __future__ import annotations

import os
from pathlib import Path


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    """The cache folder of a model repo: models--org--name."""
    return cache_dir / ("models--" + repo_id.replace("/", "--"))
