"""What the engine counts while it runs: hits, misses, bytes, stalls, expert activations.

Plain numpy arrays updated once per layer per forward (never once per expert per message);
`engine.telemetry` turns them into snapshots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.miss_curves import MissCurveRecorder


@dataclass
class TokenRecord:
    hits: int
    misses: int
    bytes_loaded: int
    stall_s: float


class EngineCounters:
    def __init__(self, num_layers: int, num_experts: int, window: int = 64) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.layer_hits = np.zeros(num_layers, dtype=np.int64)  # since load
        self.layer_misses = np.zeros(num_layers, dtype=np.int64)
        self.activation_total = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.activation_request = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.request_layer_hits = np.zeros(num_layers, dtype=np.int64)
        self.request_layer_misses = np.zeros(num_layers, dtype=np.int64)
        self.bytes_ondemand = 0
        self.bytes_prefetch = 0
        self.stall_s = 0.0
        self.request_stall_s = 0.0
        self.recent: deque[TokenRecord] = deque(maxlen=window)
        self._token = TokenRecord(0, 0, 0, 0.0)
        self.requests_started = 0
        # LRU stack distances of the routing since load: the planner's miss curves
        self.miss_curves = MissCurveRecorder(num_layers, num_experts)

    def start_request(self) -> None:
        self.requests_started += 1
        self.activation_request[:] = 0
        self.request_layer_hits[:] = 0
        self.request_layer_misses[:] = 0
        self.request_stall_s = 0.0

    def record_layer(self, layer: int, counts: np.ndarray | None, hits: int, misses: int, *, tokens: int = 1,
                     needed: list[int] | None = None) -> None:
        """`counts[e]`: tokens routed to expert e; None means one token each for the (distinct) `needed`."""
        self.miss_curves.record(layer, np.flatnonzero(counts) if needed is None else needed, tokens)
        if counts is None:  # a few scalar adds beat numpy's fancy indexing (~3x) at top-k sizes
            request, total = self.activation_request[layer], self.activation_total[layer]
            for e in needed:
                request[e] += 1
                total[e] += 1
        else:
            self.activation_request[layer] += counts
            self.activation_total[layer] += counts
        self.layer_hits[layer] += hits
        self.layer_misses[layer] += misses
        self.request_layer_hits[layer] += hits
        self.request_layer_misses[layer] += misses
        self._token.hits += hits
        self._token.misses += misses

    def record_resident_token(self, picks: np.ndarray) -> None:
        """One decode token whose every layer found its (distinct) `picks[layer]` resident: what
        `record_layer` with `needed` records for each layer, for all layers in a few array operations."""
        rows = np.arange(self.num_layers)[:, None]
        self.miss_curves.record_token(picks)
        self.activation_request[rows, picks] += 1  # (layer, expert) pairs are distinct: no lost adds
        self.activation_total[rows, picks] += 1
        hits = picks.shape[1]
        for per_layer in (self.layer_hits, self.request_layer_hits):
            per_layer += hits
        self._token.hits += hits * self.num_layers

    def record_load(self, nbytes: int, *, prefetch: bool = False) -> None:
        if prefetch:
            self.bytes_prefetch += nbytes
        else:
            self.bytes_ondemand += nbytes
        self._token.bytes_loaded += nbytes

    def record_stall(self, seconds: float) -> None:
        self.stall_s += seconds
        self.request_stall_s += seconds
        self._token.stall_s += seconds

    def end_token(self) -> TokenRecord:
        done, self._token = self._token, TokenRecord(0, 0, 0, 0.0)
        self.recent.append(done)
        return done

    @staticmethod
    def rate(hits: float, misses: float) -> float:
        total = hits + misses
        return float(hits / total) if total else 1.0

    def recent_hit_rate(self) -> float:
        return self.rate(sum(t.hits for t in self.recent), sum(t.misses for t in self.recent))

    def total_hit_rate(self) -> float:
        return self.rate(self.layer_hits.sum(), self.layer_misses.sum())
