"""What the expert heatmap shows, as arrays (Qt-free): colour values, the resident outline, cell facts.

Built for 10 updates a second at 64 layers x 256 experts: one float32 image with fixed levels
(0..1, so the view never scans for min/max) and one uint8 outline mask about the size of the plot
on screen (a one-pixel frame per resident cell), rebuilt only when residency changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.accounting.sizes import format_bytes
from engine.protocol import RoutingSnapshot, TelemetrySnapshot

MIN_FRAME_PX = 3  # cells narrower than this on screen get a tint instead of a frame
MAX_SCALE = 64  # overlay pixels per cell side, at most


def colour_values(counts: np.ndarray) -> tuple[np.ndarray, int]:
    """Counts -> float32 in [0, 1], linear in tokens (the brightest cell is the busiest expert)."""
    peak = int(counts.max()) if counts.size else 0
    if peak <= 0:
        return np.zeros(counts.shape, dtype=np.float32), 0
    values = counts.astype(np.float32)
    values *= np.float32(1.0 / peak)
    return values, peak


def _frame(sy: int, sx: int) -> np.ndarray:
    tile = np.zeros((sy, sx), dtype=np.uint8)
    tile[0, :] = tile[-1, :] = tile[:, 0] = tile[:, -1] = 1
    return tile


def overlay_scale(cell_px_x: float, cell_px_y: float) -> tuple[int, int]:
    """Overlay pixels per cell, about one per screen pixel, so the frame is one pixel thick.

    (1, 1) means "tint": cells too small on screen for a visible frame are washed over instead.
    """
    if cell_px_x < MIN_FRAME_PX or cell_px_y < MIN_FRAME_PX:
        return 1, 1
    return min(MAX_SCALE, round(cell_px_y)), min(MAX_SCALE, round(cell_px_x))


class OutlineCache:
    """The resident-experts overlay, rebuilt only when residency or the on-screen cell size changed."""

    def __init__(self) -> None:
        self.scale: tuple[int, int] = (1, 1)
        self._resident: np.ndarray | None = None
        self._frames: np.ndarray | None = None  # the tiled frame pattern, kept per shape and scale
        self.mask: np.ndarray | None = None

    @property
    def tint(self) -> bool:
        return self.scale == (1, 1)

    def update(self, resident: np.ndarray, scale: tuple[int, int] | None = None) -> bool:
        """True when the mask changed."""
        scale = scale or self.scale
        if (scale == self.scale and self._resident is not None and self._resident.shape == resident.shape
                and np.array_equal(self._resident, resident)):
            return False
        self.scale = scale
        cells = resident.view(np.uint8)
        if self.tint:
            mask = cells.copy()
        else:
            sy, sx = scale
            layers, experts = resident.shape
            if self._frames is None or self._frames.shape != (layers * sy, experts * sx):
                self._frames = np.tile(_frame(sy, sx), (layers, experts))
            mask = np.repeat(np.repeat(cells, sy, axis=0), sx, axis=1)
            mask &= self._frames
        self._resident, self.mask = resident.copy(), mask
        return True


@dataclass
class HeatmapData:
    counts: np.ndarray  # [L, E] integers
    resident: np.ndarray  # [L, E] bool
    mode: str  # reply | total
    remote: bool = False

    @classmethod
    def from_snapshot(cls, s: TelemetrySnapshot, mode: str) -> HeatmapData:
        counts = (s.activation_request if mode == "reply" else s.activation_total).numpy()
        return cls(counts, s.resident.numpy().astype(bool, copy=False), mode)

    @classmethod
    def from_routing(cls, s: RoutingSnapshot, mode: str) -> HeatmapData:
        """A remote server's routing: counts only (its memory is its own, so nothing is outlined)."""
        counts = (s.activation_request if mode == "reply" else s.activation_total).numpy()
        return cls(counts, np.zeros(counts.shape, dtype=bool), mode, remote=True)

    def describe(self, layer: int, expert: int, expert_bytes: int | None) -> str:
        """The hover text for one cell."""
        count = int(self.counts[layer, expert])
        where = "resident" if self.resident[layer, expert] else "not resident"
        if self.remote:
            where = "on the server"
        span = "this reply" if self.mode == "reply" else "since load"
        size = f" · {format_bytes(expert_bytes)}" if expert_bytes else ""
        return f"layer {layer} · expert {expert} · {count} tokens ({span}) · {where}{size}"
