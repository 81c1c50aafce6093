"""Expert routing as servers report it, turned into the heatmap's [layers, experts] token counts.

vLLM (`--enable-return-routed-experts`) puts `routed_experts` on each choice, shape
[tokens, layers, top_k]: nested lists in its documented form; newer releases may send a base64 `.npy`,
or {"encoding": "base64", "dtype", "shape", "data"}. SGLang's expert-distribution record counts
[layers, experts] (its `logical_count`, summed over any leading forward-pass axis).
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np


def decode_routed_experts(value: object) -> np.ndarray | None:
    """[tokens, layers, top_k] expert ids (negative = padding), or None when `value` carries no routing we can shape."""
    if value is None:
        return None
    try:
        if isinstance(value, dict) and {"data", "shape"} <= value.keys():
            raw = base64.b64decode(value["data"], validate=True)
            array = np.frombuffer(raw, dtype=np.dtype(value.get("dtype", "int16"))).reshape(value["shape"])
        elif isinstance(value, str):
            raw = base64.b64decode(value, validate=True)
            if not raw.startswith(b"\x93NUMPY"):
                return None  # bare bytes (SGLang's per-request field) carry no shape
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        else:
            array = np.asarray(value)
    except (ValueError, TypeError, binascii.Error):
        return None
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        return None
    return array.astype(np.int64, copy=False)


def decode_distribution(value: object) -> np.ndarray | None:
    """SGLang's record: `logical_count` as [layers, experts] token counts (leading pass axes summed)."""
    if isinstance(value, dict):
        value = value.get("logical_count")
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.int64)
    except (ValueError, TypeError):
        return None
    while array.ndim > 2:
        array = array.sum(axis=0)
    return array if array.ndim == 2 else None


class RoutingCounts:
    """Tokens routed to each (layer, expert): this reply's and since connecting. The expert axis grows to
    the largest id seen (a server does not say how many experts its model has)."""

    def __init__(self) -> None:
        self.total = np.zeros((0, 0), dtype=np.int64)
        self.reply = np.zeros((0, 0), dtype=np.int64)

    def start_reply(self) -> None:
        self.reply = np.zeros_like(self.total)

    def add_routed(self, routed: np.ndarray) -> None:
        """[tokens, layers, top_k] ids."""
        layers = routed.shape[1]
        valid = routed >= 0
        experts = int(routed.max()) + 1 if valid.any() else 0
        counts = np.zeros((layers, experts), dtype=np.int64)
        layer_index = np.broadcast_to(np.arange(layers)[None, :, None], routed.shape)
        np.add.at(counts, (layer_index[valid], routed[valid]), 1)
        self.add_counts(counts)

    def add_counts(self, counts: np.ndarray) -> None:
        """[layers, experts] token counts."""
        self.total = _grown(self.total, counts.shape)
        self.reply = _grown(self.reply, counts.shape)
        self.total[: counts.shape[0], : counts.shape[1]] += counts
        self.reply[: counts.shape[0], : counts.shape[1]] += counts


def _grown(array: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = max(array.shape[0], shape[0]), max(array.shape[1], shape[1])
    if (rows, cols) == array.shape:
        return array
    out = np.zeros((rows, cols), dtype=array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out
