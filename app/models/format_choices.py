"""Weight formats as the window offers them: the picker's choices, their labels (every quantized one
marked approximate, with its measured quality cost when the model's card has one), and the one
line that says in which formats a model is loaded. Qt-free.

A measured cost comes from the model card MoEScope's own models carry (`moescope_demo.json` in the
checkpoint folder; the demo's is `resources/models/demo/moescope_demo.json`, written by
`python -m bench.lossy_cost --formats ... --card`), under `format_quality.rows`: one row per
(expert format, dense format), of which the picker shows those with the dense weights as shipped:

    {"format_quality": {"rows": [{"expert_format": "q4_k", "dense_format": "original",
                                  "claimed_mean_delta_points": -0.1, "kl_mean": 0.00023, ...}]}}

`claimed_mean_delta_points`: held-out accuracy of the model with that format minus the float
model's, in percentage points (mean over the claimed skills); `kl_mean`: the mean KL divergence of
the next-token distributions from the float model's, in nats. Both optional.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.formats.blocks import FORMATS, parse_format

ORIGINAL = "original"
CHOICES = (ORIGINAL, "q8_0", "q6_k", "q4_k", "q3_k", "q2_k")  # what the picker offers, most precise first
CARD_FILE = "moescope_demo.json"
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class FormatQuality:
    """A format's measured cost on one model (None: not measured)."""

    accuracy_delta_points: float | None = None
    kl_mean: float | None = None

    def text(self) -> str:
        parts = []
        if self.accuracy_delta_points is not None:
            parts.append(f"{self.accuracy_delta_points:+.1f} accuracy points")
        if self.kl_mean is not None:
            parts.append(f"KL {self.kl_mean:.3g}")
        return ", ".join(parts)


def canonical(name: str | None) -> str:
    """A user's or a setting's word for a format ("4bit", "Q4_K", "") as a choice key; "original" when unknown."""
    try:
        fmt = parse_format(name)
    except ValueError:
        return ORIGINAL
    return fmt.name if fmt is not None else ORIGINAL


def model_folder(model: str) -> Path:
    """Where a model's files (and card) are: "demo" is the embedded one, anything else a folder."""
    if model == "demo":
        from resources import DEMO_MODEL_DIR

        return DEMO_MODEL_DIR
    return Path(model).expanduser()


def card_quality(model: str) -> dict[str, FormatQuality]:
    """The measured cost of each format on `model`, from its card; {} when it has none."""
    try:
        card = json.loads((model_folder(model) / CARD_FILE).read_text(encoding="utf-8"))
        rows = card["format_quality"]["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(rows, list):
        return {}
    found = {}
    for row in rows:
        if not isinstance(row, dict) or canonical(row.get("dense_format")) != ORIGINAL:
            continue
        name = canonical(row.get("expert_format"))
        quality = FormatQuality(_number(row.get("claimed_mean_delta_points")), _number(row.get("kl_mean")))
        if name != ORIGINAL and quality.text():
            found[name] = quality
    return found


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def choice_label(name: str, quality: dict[str, FormatQuality] | None = None) -> str:
    """What the picker shows: "Original", "4-bit (Q4_K), approximate", "4-bit (Q4_K), approximate: -1.2
    accuracy points" when measured."""
    name = canonical(name)
    if name == ORIGINAL:
        return "Original"
    measured = (quality or {}).get(name)
    return f"{FORMATS[name].label}, approximate" + (f": {measured.text()}" if measured is not None else "")


def choice_tip(name: str, quality: dict[str, FormatQuality]) -> str:
    """The picker's tooltip for one choice: what it stores, and what it costs on this model when measured."""
    name = canonical(name)
    if name == ORIGINAL:
        return "The checkpoint's own weights (bf16, fp16 or fp32): exact."
    fmt = FORMATS[name]
    measured = quality.get(name)
    cost = (f"Measured on this model: {measured.text()} against the original weights."
            if measured is not None else "No measured quality figure for this model.")
    return (f"{fmt.label}: {fmt.bits:.2g} bits per weight, block-quantized (GGUF's layout), converted once into "
            f"MoEScope's cache folder. Approximate: replies can differ from the original weights'. {cost}")


def loaded_formats_text(expert_format: str, dense_format: str, dtype: str) -> str:
    """How a loaded model's weights are stored: "experts Q4_K, dense bf16"."""
    def one(name: str) -> str:
        name = canonical(name)
        return SHORT_DTYPES.get(dtype, dtype) if name == ORIGINAL else name.upper()

    return f"experts {one(expert_format)}, dense {one(dense_format)}"
