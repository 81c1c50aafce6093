"""Calibration profiles: how often each expert is routed to, per model (Fiddler's popularity).

A profile is a [layers, experts] array of routing counts, saved as JSON under the user data
folder: `<user_data_dir>/moescope/profiles/<fingerprint>-<files>.json`. The fingerprint hashes the
model's config and tensor index, the second part the identity of its files
(`engine.model.conversion_cache.files_identity`), so a profile never applies to a different model,
not even a fine-tune of the same architecture. Profiles come
from a calibration run (`calibrate`: a prefill over a few built-in prompts through the engine)
or from a recorded trace (`engine.traces.trace.Trace.activation_counts`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, sold and read across Europe.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n",
    "Question: a train leaves at 3 pm and travels 180 km at 60 km/h. When does it arrive? Answer: it needs "
    "three hours, so it arrives at 6 pm.",
    "Dear team, thank you for your patience this week. The release is ready; please review the notes and "
    "reply with any concerns before Friday.",
)


def fingerprint(config: dict, tensor_index: list[tuple[str, tuple[int, ...], str]]) -> str:
    """A short stable id of a model: its config plus every tensor's name, shape and dtype."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, shape, dtype in sorted(tensor_index):
        digest.update(f"{name}:{shape}:{dtype};".encode())
    return digest.hexdigest()[:20]


def profiles_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("moescope", appauthor=False)) / "profiles"


def profile_path(model_key: str) -> Path:
    return profiles_dir() / f"{model_key}.json"


def save_profile(path: Path, counts: np.ndarray, *, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": "moescope-profile", "version": 1, "source": source,
                               "counts": np.asarray(counts).astype(int).tolist()}))
    tmp.replace(path)  # never a half-written profile


def load_profile(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """The saved counts, or None when there is no usable profile (missing, corrupt, other shape)."""
    try:
        counts = np.asarray(json.loads(path.read_text())["counts"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return counts if counts.shape == shape and counts.sum() > 0 else None


def calibration_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of the calibration prompts (fixed pseudo-text when the model has no tokenizer)."""
    if tokenizer is not None:
        return [list(tokenizer(text, add_special_tokens=True)["input_ids"]) for text in CALIBRATION_TEXTS]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, size=96).tolist() for _ in CALIBRATION_TEXTS]
