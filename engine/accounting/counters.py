"""What the engine counts while it runs: hits, misses, bytes, stalls, expert activations.

Plain numpy arrays updated once per routing step (one layer, or a whole decode token), never once
per expert; `engine.process.telemetry` turns them into snapshots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.accounting.miss_curves import MissCurveRecorder
from engine.accounting.routing import RoutingStep


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
        # the experts each layer ran for the current one-token step, when asked for (Generate.return_routing)
        self.keep_token_picks = False
        self._picks: np.ndarray | None = None  # [layers, width] int16, -1 pads
        # LRU stack distances of the routing since load: the planner's miss curves
        self.miss_curves = MissCurveRecorder(num_layers, num_experts)

    def start_request(self) -> None:
        self.requests_started += 1
        self.activation_request[:] = 0
        self.request_layer_hits[:] = 0
        self.request_layer_misses[:] = 0
        self.request_stall_s = 0.0

    def record(self, step: RoutingStep, hits: np.ndarray, misses: np.ndarray) -> None:
        """`step`'s routing, and per row of it how many of the needed experts were resident (`hits`,
        ready or loading) and how many had to be loaded (`misses`)."""
        self.miss_curves.record(step)
        rows = step.layers[:, None]
        self.activation_request[rows, step.experts] += step.counts  # (layer, expert) pairs are distinct
        self.activation_total[rows, step.experts] += step.counts
        for per_layer, values in ((self.layer_hits, hits), (self.layer_misses, misses),
                                  (self.request_layer_hits, hits), (self.request_layer_misses, misses)):
            per_layer[step.layers] += values
        self._token.hits += int(hits.sum())
        self._token.misses += int(misses.sum())
        if self.keep_token_picks and step.tokens == 1:
            self._keep_picks(step)

    def _keep_picks(self, step: RoutingStep) -> None:
        width = step.experts.shape[1]
        if self._picks is None:
            self._picks = np.full((self.num_layers, width), -1, dtype=np.int16)
        elif self._picks.shape[1] < width:  # a layer that ran more experts than the ones before it
            wider = np.full((self.num_layers, width), -1, dtype=np.int16)
            wider[:, : self._picks.shape[1]] = self._picks
            self._picks = wider
        self._picks[step.layers, :width] = step.experts

    def take_token_picks(self) -> np.ndarray | None:
        """The current one-token step's [layers, width] expert ids (kept with `keep_token_picks`), then forget them."""
        picks, self._picks = self._picks, None
        return picks

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
