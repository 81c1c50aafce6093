"""What this machine offers a model: RAM, GPU memory, free disk where the HF cache lives."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.system.memory import ENGINE_OVERHEAD_ESTIMATE, engine_overhead_bytes


@dataclass(frozen=True)
class MachineInfo:
    ram_total: int
    ram_available: int
    disk_free: int  # on the disk that holds the HF cache
    gpu_name: str | None = None
    vram_total: int = 0
    vram_free: int = 0
    cuda_usable: bool = False  # PyTorch can run on that GPU (a CPU-only build cannot)
    # what the engine process costs by itself in RAM, beside a model's dense weights and experts:
    # measured by this process's last load, else the documented estimate (engine.system.memory)
    engine_overhead: int = ENGINE_OVERHEAD_ESTIMATE
    overhead_measured: bool = False


def probe_machine(cache_dir: Path) -> MachineInfo:
    memory = psutil.virtual_memory()
    name, total, free = _probe_gpu()
    overhead, measured = engine_overhead_bytes()
    return MachineInfo(
        ram_total=memory.total,
        ram_available=memory.available,
        disk_free=disk_free(cache_dir),
        gpu_name=name,
        vram_total=total,
        vram_free=free,
        cuda_usable=name is not None and _torch_has_cuda(),
        engine_overhead=overhead,
        overhead_measured=measured,
    )


def disk_free(path: Path) -> int:
    """Free bytes on the disk of `path`, or of its nearest existing parent (the cache may not exist yet)."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 0


def _probe_gpu() -> tuple[str | None, int, int]:
    """The NVIDIA GPU with the most free memory, through the driver (nvidia-ml-py); none without one."""
    try:
        import pynvml
    except ImportError:
        return None, 0, 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, no GPU
        return None, 0, 0
    try:
        best: tuple[str | None, int, int] = (None, 0, 0)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            if memory.free > best[2]:
                name = pynvml.nvmlDeviceGetName(handle)
                best = (name.decode() if isinstance(name, bytes) else str(name), int(memory.total), int(memory.free))
        return best
    except pynvml.NVMLError:
        return None, 0, 0
    finally:
        pynvml.nvmlShutdown()


def _torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
