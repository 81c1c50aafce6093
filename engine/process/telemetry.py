"""Snapshots of what the engine is doing, for the live panels.

Built from the counters at most ~10 times a second (the worker decides when), never one message
per expert: matrices go out as `protocol.Array`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from engine.decode.runtime import MoERuntime
from engine.protocol import Array, TelemetrySnapshot

MISS_CURVE_PERIOD_S = 2.0  # the curves change slowly; recomputing them every snapshot is waste


@dataclass
class ReplyClock:
    """Timing of the reply in progress, fed by the worker's token callback."""

    request_id: str | None = None
    prompt_tokens: int = 0
    started: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def start(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id, self.prompt_tokens = request_id, prompt_tokens
        self.started, self.first_token, self.last_token, self.tokens = time.perf_counter(), None, None, 0

    def token(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += 1

    @property
    def ttft_s(self) -> float:
        return (self.first_token - self.started) if self.first_token else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return 0.0
        return (self.tokens - 1) / max(self.last_token - self.first_token, 1e-9)


@dataclass
class _Previous:
    time: float = field(default_factory=time.perf_counter)
    ondemand: int = 0
    prefetch: int = 0


class TelemetryBuilder:
    def __init__(self, runtime: MoERuntime, started: float) -> None:
        self.runtime = runtime
        self.started = started
        self.process = psutil.Process()
        self.previous = _Previous(ondemand=runtime.counters.bytes_ondemand, prefetch=runtime.counters.bytes_prefetch)
        self.gpu = _GpuProbe(runtime.device.index or 0) if runtime.device.type == "cuda" else None
        self._curves: Array | None = None
        self._curves_at = 0.0

    def link(self) -> str:
        if self.runtime.device.type == "cuda":
            return "PCIe host -> GPU"
        return "disk -> RAM" if self.runtime.store.kind == "disk" else "RAM -> RAM"

    def snapshot(self, state: str, clock: ReplyClock) -> TelemetrySnapshot:
        rt, c = self.runtime, self.runtime.counters
        now = time.perf_counter()
        dt = max(now - self.previous.time, 1e-6)
        ondemand_rate = (c.bytes_ondemand - self.previous.ondemand) / dt
        prefetch_rate = (c.bytes_prefetch - self.previous.prefetch) / dt
        self.previous = _Previous(now, c.bytes_ondemand, c.bytes_prefetch)
        memory = psutil.virtual_memory()
        req_hits, req_misses = c.request_layer_hits.sum(), c.request_layer_misses.sum()
        gpu = self.gpu.read() if self.gpu else {}
        policy = rt.cache.policy
        extra = rt.cache.stats()
        return TelemetrySnapshot(
            time=now - self.started,
            state=state,
            request_id=clock.request_id,
            decode_tokens_per_s=clock.decode_tokens_per_s,
            prefill_tokens_per_s=clock.prefill_tokens_per_s,
            ttft_s=clock.ttft_s,
            tokens_generated=clock.tokens,
            hit_rate_recent=c.recent_hit_rate(),
            hit_rate_total=c.total_hit_rate(),
            hit_rate_request=c.rate(req_hits, req_misses),
            recent_window=c.recent.maxlen or 0,
            layer_hit_rate=Array.of(_rates(c.layer_hits, c.layer_misses)),
            layer_hit_rate_request=Array.of(_rates(c.request_layer_hits, c.request_layer_misses)),
            bytes_per_s_ondemand=ondemand_rate,
            bytes_per_s_prefetch=prefetch_rate,
            stall_s_per_token=c.request_stall_s / clock.tokens if clock.tokens else 0.0,
            bytes_loaded_total=c.bytes_ondemand + c.bytes_prefetch,
            activation_request=Array.of(c.activation_request.astype(np.int32)),
            activation_total=Array.of(c.activation_total),
            resident=Array.of(rt.cache.resident_matrix()),
            slots_per_layer=rt.cache.slots_per_layer,
            budget_bytes=rt.cache.budget_bytes,
            policy=policy.name,
            link=self.link(),
            rss_bytes=self.process.memory_info().rss,
            ram_used_bytes=memory.total - memory.available,
            ram_total_bytes=memory.total,
            gpu_used_bytes=gpu.get("used"),
            gpu_total_bytes=gpu.get("total"),
            pcie_rx_bytes_per_s=gpu.get("rx"),
            pcie_tx_bytes_per_s=gpu.get("tx"),
            miss_curves=self._miss_curves(now),
            decode_path=rt.decode_path,
            decode_path_reason=rt.decode_path_reason,
            extra=extra,
        )

    def _miss_curves(self, now: float) -> Array | None:
        curves_fn = getattr(self.runtime, "miss_curves", None)
        if curves_fn is not None and now - self._curves_at >= MISS_CURVE_PERIOD_S:
            curves = curves_fn()
            self._curves = Array.of(np.asarray(curves, dtype=np.float32)) if curves is not None else None
            self._curves_at = now
        return self._curves


def _rates(hits: np.ndarray, misses: np.ndarray) -> np.ndarray:
    total = hits + misses
    return np.where(total > 0, hits / np.maximum(total, 1), 1.0).astype(np.float32)


class _GpuProbe:
    """Device memory and the driver's PCIe throughput counters, through nvidia-ml-py."""

    def __init__(self, index: int) -> None:
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no driver library: the panels simply show our own counts
            self.handle = None

    def read(self) -> dict:
        if self.handle is None:
            return {}
        nv = self.nvml
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(self.handle)
            # The driver reports KB/s sampled over 20 ms windows.
            rx = nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
            tx = nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
            return {"used": int(mem.used), "total": int(mem.total), "rx": rx, "tx": tx}
        except Exception:
            return {}
