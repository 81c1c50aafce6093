"""Fiddler (Kamahori et al. 2024): with a GPU, compute a missing expert on the CPU when that is faster.

A miss normally costs copy (host -> GPU) + GPU compute. For few tokens (decoding), running the
expert where its weights already are - host RAM - is often cheaper than moving ~MBs over PCIe. A
latency model calibrated at load decides per miss:

    cpu_time(tokens) < copy_time + gpu_time(tokens)   ->  compute on the CPU

CPU execution needs the expert's bytes in host RAM, so it is used with the RAM store only; on a
CPU-only machine there is nothing to decide and this module is never used. The CPU result is
numerically equivalent but may differ from GPU compute in the last bits, which is why the
option is off unless asked for (`--cpu-experts auto`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.model.layout import MoELayout
from engine.offload.expert_compute import expert_mlp
from engine.offload.store import ExpertStore


@dataclass(frozen=True)
class LatencyModel:
    copy_s: float  # one expert host -> GPU
    cpu_fixed_s: float  # CPU compute: fixed + per-token cost
    cpu_per_token_s: float
    gpu_fixed_s: float
    gpu_per_token_s: float

    def cpu_s(self, tokens: int) -> float:
        return self.cpu_fixed_s + self.cpu_per_token_s * tokens

    def gpu_s(self, tokens: int) -> float:
        return self.gpu_fixed_s + self.gpu_per_token_s * tokens

    def prefers_cpu(self, tokens: int) -> bool:
        return self.cpu_s(tokens) < self.copy_s + self.gpu_s(tokens)


def host_views(layout: MoELayout, host: torch.Tensor) -> dict[str, torch.Tensor]:
    return {p.name: host[p.offset : p.offset + p.nbytes].view(p.dtype).view(*p.shape) for p in layout.params}


def supported(module: torch.nn.Module, store: ExpertStore, device: torch.device) -> bool:
    # post-expert norms are GPU modules; a disk store has no host copy to compute from; quantized
    # experts would have to be dequantized on the CPU first, which defeats the point
    return (device.type == "cuda" and store.host_view(0, 0) is not None and not store.layout.quantized
            and not getattr(module, "has_post_expert_norm", False))


def _timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(
    layout: MoELayout, store: ExpertStore, module: torch.nn.Module, device: torch.device, hidden: int
) -> LatencyModel:
    """Measure copy, CPU and GPU times for one expert of the first MoE layer (`hidden`: model width)."""
    host = store.host_view(0, 0)
    gpu_slot = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=device)
    cpu_w = host_views(layout, host)

    def copy() -> None:
        gpu_slot.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    copy()
    gpu_w = host_views(layout, gpu_slot)
    copy_s = _timed(copy)
    dtype = layout.params[0].dtype
    fits: dict[str, list[float]] = {}
    for where, weights, dev in (("cpu", cpu_w, torch.device("cpu")), ("gpu", gpu_w, device)):
        points = []
        for tokens in (1, 16):
            x = torch.randn(tokens, hidden, dtype=dtype, device=dev)

            def run(x=x, weights=weights, dev=dev) -> None:
                expert_mlp(module, x, weights)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            run()
            points.append(_timed(run))
        per_token = max(0.0, (points[1] - points[0]) / 15)
        fits[where] = [max(0.0, points[0] - per_token), per_token]
    return LatencyModel(copy_s, *fits["cpu"], *fits["gpu"])


class CpuExperts:
    def __init__(self, layout: MoELayout, store: ExpertStore, model: LatencyModel) -> None:
        self.layout, self.store, self.model = layout, store, model
        self.runs = 0

    def prefers_cpu(self, tokens: int) -> bool:
        return self.model.prefers_cpu(tokens)

    @torch.inference_mode()
    def run(self, layer: int, expert: int, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The expert's output for rows `x` (on the GPU), computed on the CPU from the host copy."""
        self.runs += 1
        weights = host_views(self.layout, self.store.host_view(layer, expert))
        y = expert_mlp(module, x.to("cpu"), weights)
        return y.to(x.device)

    def stats(self) -> dict[str, float]:
        return {"cpu_expert_runs": float(self.runs), "cpu_expert_copy_ms": self.model.copy_s * 1e3}
