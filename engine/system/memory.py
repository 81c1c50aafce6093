"""This process's memory, as the kernel reports it."""

from __future__ import annotations

import ctypes
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def proc_bytes(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes; None where there is no such file or line."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class ProcessMemory:
    """What this process remembers about its own memory between calls: one per process, `PROCESS`,
    which the functions below read and update."""

    peak_before_reset: int = 0  # the process's peak before the last reset_phase_peak
    baseline: int | None = None  # resident memory before any weights, taken the first time it is asked
    measured_overhead: int | None = None  # EngineOverhead.total_bytes of this process's last load


PROCESS = ProcessMemory()


def phase_peak_rss_bytes() -> int:
    """The peak resident memory since the last reset_phase_peak (on Linux; elsewhere since the start).

    On Linux, VmHWM belongs to this program's own address space; ru_maxrss would also count
    the parent's memory before exec (a process started from a big one would look big).
    """
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started, across phase resets."""
    return max(PROCESS.peak_before_reset, phase_peak_rss_bytes())


def reset_phase_peak() -> bool:
    """Start measuring a phase's peak from the memory resident now (Linux: clear_refs resets VmHWM);
    peak_rss_bytes keeps the whole process's. False where the peak cannot be reset."""
    PROCESS.peak_before_reset = peak_rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def glibc(function: str):
    """A function of the C library this process already runs on, where it is glibc on Linux; None
    elsewhere (another OS, or a libc without it, e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), function)
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). A load's conversions and
    temporaries leave freed memory that the process would otherwise keep resident; elsewhere a no-op."""
    if (trim := glibc("malloc_trim")) is not None:
        trim(0)


MADV_PAGEOUT = 21  # Linux 5.4 and later (linux/mman.h); Python's mmap module names it only on some builds


def release_file_pages(paths: Iterable[Path]) -> int:
    """Drop this process's resident pages of the files at `paths`: checkpoint mappings whose weights
    were copied elsewhere (`huge_pages.gather`) still hold the pages the copy read, the dense weights
    a second time. MADV_PAGEOUT keeps every byte (a clean page comes back from the file on its next
    read, a written one is swapped or kept), unlike MADV_DONTNEED, which would drop a private
    mapping's changes. Returns the bytes of mapping advised; 0 where not Linux or refused."""
    madvise = glibc("madvise")
    wanted = {str(Path(path).resolve()) for path in paths}
    if madvise is None or not wanted:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    try:
        with open("/proc/self/maps") as maps:
            ranges = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return 0
    for fields in ranges:
        if len(fields) == 6 and fields[5].strip() in wanted:
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if madvise(start, end - start, MADV_PAGEOUT) == 0:
                advised += end - start
    return advised


def resident_bytes(address: int, nbytes: int) -> int:
    """How many of the `nbytes` at `address` are in this process's memory now, counted by whole
    pages: mapped into its page table (/proc/self/pagemap's present bit). Not mincore, which says
    whether a file's page is in the page cache, mapped here or not. `nbytes` where that cannot be
    read (not Linux)."""
    if nbytes <= 0:
        return 0
    page = resource.getpagesize()
    first, last = address // page, (address + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return nbytes
    present = int(np.count_nonzero(entries >> np.uint64(63)))
    return min(nbytes, present * page)


# A forward's buffers (a prompt's activations, the kernels' scratch, torch's outputs) are freed and asked
# for again at every step. With glibc's adaptive defaults a buffer of a few MiB comes from a fresh mmap,
# or the freed top of the heap is handed back, and each prompt faults its working memory in again as
# zeroed pages (a few percent of a prefill). Up to this much freed heap stays mapped instead: at most
# that much resident memory beyond what is in use, well inside the fit estimate's activation margin.
KEPT_FREE_HEAP = 32 * 1024**2  # glibc's own ceiling for the mmap threshold on 64-bit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def keep_freed_heap(limit: int = KEPT_FREE_HEAP) -> bool:
    """Have glibc keep up to `limit` bytes of freed heap for the next step's buffers, and serve
    allocations below it from the heap; False where the C library has no mallopt (elsewhere than
    glibc) or refused. release_free_heap still hands everything back when called."""
    mallopt = glibc("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))


def rss_bytes() -> int:
    """This process's resident memory now."""
    now = proc_bytes("/proc/self/status", "VmRSS")
    if now is not None:
        return now
    import psutil

    return psutil.Process().memory_info().rss


MiB = 1024**2
# What the engine process costs by itself (Python, torch, transformers, the engine's code, a model's
# modeling code and tokenizer, the native kernels) before it has measured itself, for no model in
# particular: at least every engine-own figure at a run's peak that `python -m bench.estimate_check`
# measured on the CPU build (bench/results/estimate-check-*.md), rounded up. Once a model has loaded,
# the measured figure replaces it; the fit verdict takes the larger of either and the model's own
# footprint (engine.hub.footprint), which grows with its layers and experts.
ENGINE_OVERHEAD_ESTIMATE = 480 * MiB


def baseline_rss_bytes() -> int:
    """This process's resident memory before any weights: taken the first time it is asked (the
    runtime asks before it reads a model, after the generation path's imports), then kept, so a
    second model's load does not count the first one's leftovers."""
    if PROCESS.baseline is None:
        PROCESS.baseline = rss_bytes()
    return PROCESS.baseline


@dataclass(frozen=True)
class EngineOverhead:
    """The engine process's own memory, measured at the end of a load."""

    baseline_bytes: int  # before any weights: the interpreter, torch, transformers, the engine's code
    loaded_bytes: int  # resident when the load finished
    dense_bytes: int  # of that, the model's dense weights in this process's memory (0 on a GPU)
    expert_bytes: int  # of that, experts: a RAM store, slots filled so far (an untouched slot is not resident)
    # resident at the peak of the load's first forward (0 where unmeasured): a forward's working
    # memory (activations, freed temporaries the heap keeps) comes back with every reply
    forward_peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything but dense weights and experts: what a memory limit loses before the budget."""
        resident = max(self.loaded_bytes, self.forward_peak_bytes)
        return max(self.baseline_bytes, resident - self.dense_bytes - self.expert_bytes)

    @property
    def model_bytes(self) -> int:
        """What the model added beyond its weights: its modeling code, tokenizer, kernels, buffers."""
        return self.total_bytes - self.baseline_bytes


def note_overhead(overhead: EngineOverhead) -> None:
    """Remember the latest measurement, for fit estimates made in this process."""
    PROCESS.measured_overhead = overhead.total_bytes


def engine_overhead_bytes() -> tuple[int, bool]:
    """(bytes, measured): the engine's own memory as this process measured it at its last load,
    else the documented estimate."""
    if PROCESS.measured_overhead is not None:
        return PROCESS.measured_overhead, True
    return ENGINE_OVERHEAD_ESTIMATE, False
