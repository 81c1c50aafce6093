"""The time series the panels scroll through, kept from every snapshot (Qt-free).

Every snapshot is recorded (cheap: a few floats and one row of per-layer rates), while the panels
repaint only at the frame rate from whatever is here.
"""

from __future__ import annotations

import numpy as np

from engine.protocol import TelemetrySnapshot

SERIES = (
    "hit_rate_recent", "hit_rate_total", "hit_rate_request", "bytes_per_s_ondemand", "bytes_per_s_prefetch",
    "pcie_rx_bytes_per_s", "stall_s_per_token", "decode_tokens_per_s",
)


def connections(times: np.ndarray, max_gap_s: float = 1.0) -> np.ndarray:
    """pyqtgraph's `connect` array: no line across idle gaps (snapshots stop between replies)."""
    if len(times) < 2:
        return np.ones(len(times), dtype=bool)
    joined = np.ones(len(times), dtype=bool)
    joined[:-1] = np.diff(times) <= max_gap_s
    return joined


class RingSeries:
    """A fixed-capacity table of rows (time + named columns) in numpy, oldest first on read."""

    def __init__(self, capacity: int, columns: tuple[str, ...]) -> None:
        self.capacity = capacity
        self.columns = {name: i for i, name in enumerate(columns)}
        self._t = np.zeros(capacity, dtype=np.float64)
        self._v = np.full((capacity, len(columns)), np.nan, dtype=np.float64)
        self._n = 0  # rows ever written

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    def append(self, t: float, values: dict[str, float | None]) -> None:
        i = self._n % self.capacity
        self._t[i] = t
        row = self._v[i]
        row[:] = np.nan
        for name, value in values.items():
            if value is not None:
                row[self.columns[name]] = value
        self._n += 1

    def _order(self) -> np.ndarray:
        n = len(self)
        start = self._n % self.capacity if self._n > self.capacity else 0
        return (np.arange(n) + start) % self.capacity

    def times(self) -> np.ndarray:
        return self._t[self._order()]

    def column(self, name: str) -> np.ndarray:
        return self._v[self._order(), self.columns[name]]

    def clear(self) -> None:
        self._n = 0


class LayerSeries:
    """Per-layer figures over time: [capacity, layers], for "any one layer picked from a list"."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: np.ndarray | None = None
        self._n = 0

    def append(self, row: np.ndarray) -> None:
        if self._data is None or self._data.shape[1] != row.shape[0]:
            self._data = np.full((self.capacity, row.shape[0]), np.nan, dtype=np.float32)
            self._n = 0
        self._data[self._n % self.capacity] = row
        self._n += 1

    def layer(self, index: int) -> np.ndarray:
        if self._data is None or not 0 <= index < self._data.shape[1]:
            return np.zeros(0, dtype=np.float32)
        n = min(self._n, self.capacity)
        start = self._n % self.capacity if self._n > self.capacity else 0
        return self._data[(np.arange(n) + start) % self.capacity, index]

    def clear(self) -> None:
        self._data, self._n = None, 0


class TelemetryHistory:
    """The last `capacity` snapshots' scalars (default 2 minutes at 10 per second)."""

    def __init__(self, capacity: int = 1200) -> None:
        self.series = RingSeries(capacity, SERIES)
        self.layer_request = LayerSeries(capacity)
        self.layer_total = LayerSeries(capacity)
        self.latest: TelemetrySnapshot | None = None
        self.count = 0

    def add(self, s: TelemetrySnapshot) -> None:
        if self.latest is not None and s.time < self.latest.time:
            self.clear()  # a restarted engine counts time from zero again
        self.series.append(s.time, {name: getattr(s, name) for name in SERIES})
        self.layer_request.append(s.layer_hit_rate_request.numpy())
        self.layer_total.append(s.layer_hit_rate.numpy())
        self.latest = s
        self.count += 1

    def clear(self) -> None:
        self.series.clear()
        self.layer_request.clear()
        self.layer_total.clear()
        self.latest = None
