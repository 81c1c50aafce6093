"""Whether and how a model runs on this machine: a verdict with the numbers behind it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.hub.estimate import CONTEXT_TOKENS, SizeEstimate
from engine.hub.machine import MachineInfo
from engine.sizes import format_bytes

GiB = 1024**3
MiB = 1024**2
RUNTIME_RAM = 768 * MiB  # Python + torch + transformers + tokenizer (~0.4 GiB measured, README) with headroom
GPU_RESERVE = 768 * MiB  # CUDA context, kernel workspaces, allocator slack
CPU_CACHE_SHARE = 0.8  # of the RAM left after dense weights: the rest stays free for the page cache and other apps
RAM_STORE_SHARE = 0.6  # the engine keeps experts in RAM (GPU runs) only below this share of free RAM (engine.runtime)


@dataclass
class FitVerdict:
    kind: str  # fits-gpu | fits-ram | offload | too-big | unsupported
    headline: str  # one line with the numbers
    device: str | None = None  # cuda | cpu
    store: str | None = None  # ram | disk
    budget_bytes: int | None = None  # the recommended --budget
    budget_arg: str | None = None  # the same, written for --budget
    disk_short_bytes: int = 0  # more free disk the download needs
    details: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.kind in ("fits-gpu", "fits-ram", "offload")


def assess(est: SizeEstimate, machine: MachineInfo, *, missing_bytes: int | None = None) -> FitVerdict:
    """Judge `est` against `machine`; `missing_bytes` is what is still to download (None: nothing/unknown)."""
    verdict = _run_verdict(est, machine)
    if missing_bytes and missing_bytes > machine.disk_free:
        verdict.disk_short_bytes = missing_bytes - machine.disk_free
        verdict.headline = (
            f"needs {format_bytes(verdict.disk_short_bytes)} more disk (download {format_bytes(missing_bytes)}, "
            f"{format_bytes(machine.disk_free)} free); then: {verdict.headline}"
        )
    return verdict


def _run_verdict(est: SizeEstimate, m: MachineInfo) -> FitVerdict:
    if est.problem:
        return FitVerdict("unsupported", f"cannot run yet: {est.problem}")
    kv = est.kv_bytes
    details = [f"working memory: KV cache for {CONTEXT_TOKENS} tokens {format_bytes(kv)}"]
    if m.gpu_name and not m.cuda_usable:
        details.append(f"GPU {m.gpu_name} found, but this PyTorch build has no CUDA support: estimated for the CPU")
    if m.cuda_usable:
        gpu_fixed = est.dense_bytes + kv + GPU_RESERVE
        if gpu_fixed + est.all_expert_bytes <= m.vram_free:
            return FitVerdict(
                "fits-gpu",
                f"fits in GPU memory: {format_bytes(est.dense_bytes)} dense + {format_bytes(est.all_expert_bytes)} "
                f"experts of {format_bytes(m.vram_free)} free on {m.gpu_name}; use --budget all",
                "cuda", "ram", est.all_expert_bytes, "all", details=details,
            )
        if gpu_fixed + est.min_budget_bytes <= m.vram_free:
            budget = _whole_slots(min(est.all_expert_bytes, m.vram_free - gpu_fixed), est)
            store = "ram" if est.all_expert_bytes < RAM_STORE_SHARE * m.ram_available else "disk"
            return FitVerdict(
                "offload",
                f"runs on {m.gpu_name} with experts offloaded to {'RAM' if store == 'ram' else 'disk'}, budget "
                f"{format_bytes(budget)} recommended (minimum {format_bytes(est.min_budget_bytes)}, all experts "
                f"{format_bytes(est.all_expert_bytes)}; {format_bytes(m.vram_free)} GPU memory free)",
                "cuda", store, budget, budget_arg(budget, est), details=details,
            )
        details.append(
            f"dense weights + minimum budget ({format_bytes(gpu_fixed - GPU_RESERVE + est.min_budget_bytes)}) "
            f"exceed the free GPU memory ({format_bytes(m.vram_free)}): estimated for the CPU"
        )
    cpu_fixed = est.dense_bytes + kv + RUNTIME_RAM
    if cpu_fixed + est.all_expert_bytes <= m.ram_available:
        return FitVerdict(
            "fits-ram",
            f"fits in RAM: {format_bytes(cpu_fixed + est.all_expert_bytes)} with every expert resident, "
            f"{format_bytes(m.ram_available)} available; use --budget all",
            "cpu", "disk", est.all_expert_bytes, "all", details=details,
        )
    if cpu_fixed + est.min_budget_bytes <= m.ram_available:
        room = int((m.ram_available - cpu_fixed) * CPU_CACHE_SHARE)
        budget = _whole_slots(max(est.min_budget_bytes, min(est.all_expert_bytes, room)), est)
        return FitVerdict(
            "offload",
            f"runs with experts offloaded to disk, budget {format_bytes(budget)} recommended (minimum "
            f"{format_bytes(est.min_budget_bytes)}, all experts {format_bytes(est.all_expert_bytes)}; "
            f"{format_bytes(m.ram_available)} RAM available)",
            "cpu", "disk", budget, budget_arg(budget, est), details=details,
        )
    return FitVerdict(
        "too-big",
        f"too big for this machine: needs at least {format_bytes(cpu_fixed + est.min_budget_bytes)} of memory "
        f"(dense {format_bytes(est.dense_bytes)} + minimum budget {format_bytes(est.min_budget_bytes)} + working "
        f"memory {format_bytes(kv + RUNTIME_RAM)}), {format_bytes(m.ram_available)} RAM available",
        details=details,
    )


def _whole_slots(nbytes: int, est: SizeEstimate) -> int:
    """Round down to whole expert slots (what the planner allocates), never below the minimum."""
    if est.bytes_per_expert <= 0:
        return nbytes
    return max(est.min_budget_bytes, nbytes // est.bytes_per_expert * est.bytes_per_expert)


def budget_arg(nbytes: int, est: SizeEstimate) -> str:
    """`nbytes` written for --budget, rounded down but never below the minimum budget."""
    if nbytes >= est.all_expert_bytes:
        return "all"
    gib = math.floor(nbytes / GiB * 10) / 10
    if gib >= 1 and gib * GiB >= est.min_budget_bytes:
        return f"{gib:g}GiB"
    return f"{max(math.floor(nbytes / MiB), math.ceil(est.min_budget_bytes / MiB))}MiB"
