"""`python -m bench.overhead [--models demo,qwen3moe-mini] [--out DIR]`: the engine process's own memory.

Each model is measured in a fresh process, resident memory (VmRSS) at the points that matter:
the bare interpreter; after torch; after transformers; after the generation path's imports (what
the engine holds before any weights); the model skeleton built on the meta device (`moescope info`:
the model's code, no weights); the runtime loaded at budget `all` (the engine's own split:
`engine.system.memory.EngineOverhead`); after decoding; and after replies to prompts of as many
new lengths, with the heap's free pages handed back (what stays is kept on purpose: oneDNN keeps a
generated kernel per matrix shape it meets). "Overhead" is resident memory beyond the
dense weights and the expert bytes in memory: what a memory limit loses before the budget.
`ENGINE_OVERHEAD_ESTIMATE` (engine/system/memory.py) is this table's largest figure, rounded up
with room for a real model's tokenizer (the checkpoints here have toy ones or none).
The loaded engine's overhead is also split by part (issue 62): each mapping of /proc/self/smaps
(shared libraries' code, the checkpoint's file pages, glibc's heaps, thread stacks, the huge-page
mappings less the weights they hold), glibc's mallinfo2 and Python's arenas; what no part claims
is shown as unattributed. Also lists the modules the generation path imports that it need not (the cut ones stay cut:
tests/test_overhead.py). Writes bench/results/overhead-<host>-<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

MiB = 1024**2
DECODE_TOKENS = 32
NEW_LENGTHS = 48  # replies to prompts of 2, 3, ... tokens: each length is a new set of matrix shapes
# imported lazily by the engine since this benchmark (where a conversion or a Hub command needs them)
LAZY = ("gguf", "sentencepiece")


def rss() -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:"))


# ----- the loaded engine's memory by part: /proc/self/smaps per mapping, glibc's mallinfo2 -----
STACK = 8 * MiB  # glibc's default thread stack (RLIMIT_STACK), below it a one-page guard
THREAD_ARENA = 64 * MiB  # glibc's per-thread malloc heaps: 64 MiB-aligned reservations on 64-bit
HUGE = "huge-page mappings (weights + rounding)"
WEIGHT_FILES = (".safetensors", ".gguf", ".bin", ".npy")


def mappings() -> list[dict]:
    """Every mapping of this process: start, end, perms, path ('' anonymous), Rss, AnonHugePages, VmFlags."""
    maps: list[dict] = []
    header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
    with open("/proc/self/smaps") as lines:
        for line in lines:
            if (m := header.match(line)) is not None:
                maps.append({"start": int(m[1], 16), "end": int(m[2], 16), "perms": m[3], "path": m[4].strip(),
                             "Rss": 0, "AnonHugePages": 0, "flags": ""})
            elif line.startswith("VmFlags:"):
                maps[-1]["flags"] = line.split(":", 1)[1]
            elif line.split(":")[0] in ("Rss", "AnonHugePages"):
                maps[-1][line.split(":")[0]] = int(line.split()[1]) * 1024
    return maps


def library_part(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if name.startswith("libtorch_cpu"):
        return "code: libtorch_cpu (ATen, oneDNN, MKL-DNN)"
    if "/torch/" in path or name.startswith(("libgomp", "libc10", "libiomp", "libmkl", "libshm")):
        return "code: other torch libraries, OpenMP"
    if name.startswith(("python", "libpython")):
        return "code: the interpreter"
    if "/engine/" in path and ".so" in name:
        return "code: the engine's native kernels"
    if name.endswith(WEIGHT_FILES):
        return "file: checkpoint pages (read, not held)"
    if ".cpython-" in name or ".abi3." in name or "/lib-dynload/" in path:
        return "code: Python extension modules (numpy, tokenizers, safetensors...)"
    if ".so" in name:
        return "code: other shared libraries (libc, libstdc++, OpenBLAS...)"
    return "file: other files"


def mallinfo2() -> dict[str, int]:
    """glibc's heap: bytes its arenas hold (sbrk + thread heaps), in use, free, in mmapped chunks; {} elsewhere."""
    import ctypes

    from engine.system.memory import glibc

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    call = glibc("mallinfo2")
    if call is None:
        return {}
    call.restype = Info
    info = call()
    return {"arena": info.arena, "in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd,
            "mmapped_chunks": info.hblks}


def pymalloc_bytes() -> int:
    """Bytes in Python's small-object arenas (sys._debugmallocstats, which writes to the C stderr)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        found = re.search(r"(\d+) arenas \* (\d+) bytes/arena", out.read())
    return int(found[1]) * int(found[2]) if found else 0


def weight_ranges(runtime) -> list[tuple[int, int]]:
    """(start, end) of every CPU storage holding weights: the model's dense tensors and the cache's pools."""
    if runtime is None:
        return []
    from engine.model.inspect import cpu_storages

    model = runtime.model
    storages = cpu_storages(model.parameters(), model.buffers(), runtime.cache.pools)
    return [(start, start + n) for start, n in storages.items()]


def thread_arena(maps: list[dict], i: int) -> bool:
    """Whether mapping i (64 MiB-aligned, writable) is a glibc thread heap: with its reserved tail, 64 MiB."""
    m, after = maps[i], maps[i + 1] if i + 1 < len(maps) else None
    if m["end"] - m["start"] == THREAD_ARENA:
        return True
    return (after is not None and after["start"] == m["end"] and after["perms"].startswith("---")
            and after["end"] - m["start"] == THREAD_ARENA)


def parts(runtime=None) -> dict:
    """This process's resident memory by part now, in bytes (sums to VmRSS, up to the kernel's lazy counters)."""
    maps = mappings()
    by: dict[str, int] = {}

    weights_in: dict[str, int] = {}  # the weights' bytes inside each part's mappings (mapped, maybe not resident)

    def add(part: str, n: int) -> None:
        by[part] = by.get(part, 0) + n
        held = sum(max(0, min(e, m["end"]) - max(s, m["start"])) for s, e in weights)
        weights_in[part] = weights_in.get(part, 0) + held

    weights = weight_ranges(runtime)
    stacks = 0
    for i, m in enumerate(maps):
        size, path, resident = m["end"] - m["start"], m["path"], m["Rss"]
        below = maps[i - 1] if i else None
        if path and not path.startswith("["):
            add(library_part(path), resident)
        elif path == "[heap]":
            add("glibc heap: main arena ([heap])", resident)
        elif path == "[stack]":
            add("thread stacks (main + pthread/OpenMP)", resident)
        elif path:
            add("kernel: vdso, vvar, vsyscall", resident)
        elif " hg" in m["flags"]:  # madvised for huge pages: huge_pages.empty (dense arena, expert pools)
            add("huge-page mappings (weights + rounding)", resident)
        elif "x" in m["perms"]:
            add("JIT code (oneDNN's generated kernels)", resident)
        elif (size == STACK and m["perms"].startswith("rw") and below is not None and below["end"] == m["start"]
              and below["perms"].startswith("---") and not below["path"]):
            add("thread stacks (main + pthread/OpenMP)", resident)
            stacks += 1
        elif m["start"] % THREAD_ARENA == 0 and m["perms"].startswith("rw") and thread_arena(maps, i):
            add("glibc heap: thread arenas", resident)
        else:
            add("other anonymous (pymalloc, numpy, mmapped malloc chunks, torch tensors)", resident)
    huge_weights = weights_in.get(HUGE, 0)
    huge = by.get(HUGE, 0)
    threads = len(os.listdir("/proc/self/task"))
    heap = mallinfo2()
    return {"by_part": by, "huge_weights": huge_weights, "huge_rounding": huge - huge_weights,
            "weights_in": {part: n for part, n in weights_in.items() if n and part != HUGE},
            "anon_huge_pages": sum(m["AnonHugePages"] for m in maps), "threads": threads, "thread_stacks": stacks,
            "heap": heap, "pymalloc": pymalloc_bytes(), "rss": rss()}


def measure(model: str) -> dict:
    """In this (fresh) process: resident memory at each point."""
    points = {"interpreter": rss()}
    import torch

    points["+ torch"] = rss()
    import transformers  # noqa: F401

    points["+ transformers"] = rss()
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.process import worker  # noqa: F401  (the engine process's own imports)
    from engine.system.memory import baseline_rss_bytes, release_free_heap

    points["+ generation path imports"] = baseline_rss_bytes()  # the runtime's baseline: taken here, before the skeleton
    at_imports = parts()
    lazy_loaded = [name for name in LAZY if name in sys.modules]
    from engine.hub.estimate import kv_cache_bytes_per_token
    from engine.hub.local import resolve_model
    from engine.model.loader import build_model

    path = resolve_model(model)
    skeleton = build_model(path, device=torch.device("meta"), load_dense=False)
    points["+ model skeleton (meta)"] = rss()
    del skeleton
    from engine.protocol import LoadModel, SamplingSettings

    torch.set_num_threads(2)
    runtime = MoERuntime(LoadModel(path=str(path), budget="all"))
    points["loaded (budget all)"] = rss()
    at_load = parts(runtime)
    overhead = runtime.overhead
    generator = Generator(runtime)
    prompt = list(range(3, 19))
    generator.generate(prompt, SamplingSettings(temperature=0, max_new_tokens=DECODE_TOKENS))
    points[f"after {DECODE_TOKENS} decode tokens"] = rss()
    for length in range(2, 2 + NEW_LENGTHS):
        generator.generate(list(range(3, 3 + length)), SamplingSettings(temperature=0, max_new_tokens=4))
    release_free_heap()  # what stays is kept on purpose (caches), not a long prompt's freed activations
    points[f"after {NEW_LENGTHS} prompts of new lengths, heap trimmed"] = rss()
    at_end = parts(runtime)
    in_memory = overhead.dense_bytes + runtime.layout.all_expert_bytes  # every expert is resident at `all`
    kv_per_token = kv_cache_bytes_per_token(runtime.model.config, torch.empty((), dtype=runtime.dtype).element_size())
    return {
        "model": model, "points": points, "dense_bytes": overhead.dense_bytes,
        "expert_bytes": runtime.layout.all_expert_bytes, "baseline_bytes": overhead.baseline_bytes,
        "overhead_at_load": overhead.total_bytes, "overhead_decoding": points[f"after {DECODE_TOKENS} decode tokens"] - in_memory,
        "overhead_new_lengths": points[f"after {NEW_LENGTHS} prompts of new lengths, heap trimmed"] - in_memory,
        "lazy_modules_loaded": lazy_loaded,
        "parts_at_imports": at_imports, "parts_at_load": at_load, "parts_at_end": at_end,
        "first_forward_working_set": max(0, overhead.forward_peak_bytes - overhead.loaded_bytes),
        "kv_bytes_per_token": kv_per_token, "staging_bytes_bound": 2 * runtime.layout.slot_bytes,
        "modules_imported": len(sys.modules),
    }


def model_path(name: str) -> str:
    from bench.synthetic import GEOMETRIES, build_checkpoint

    return str(build_checkpoint(name)) if name in GEOMETRIES else name


def run_child(model: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.overhead", "--child", model_path(model)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"model": model, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["model"] = model
    return result


def table(results: list[dict]) -> list[str]:
    ok = [r for r in results if "error" not in r]
    lines = ["# The engine process's own memory (resident, MiB)", "",
             "| point | " + " | ".join(r["model"] for r in ok) + " |", "|---|" + "---:|" * len(ok)]
    for point in (ok[0]["points"] if ok else {}):
        lines.append(f"| {point} | " + " | ".join(f"{r['points'][point] / MiB:.1f}" for r in ok) + " |")
    for label, key in (("dense weights in RAM", "dense_bytes"), ("experts (all resident)", "expert_bytes"),
                       ("**overhead at load** (engine's own figure)", "overhead_at_load"),
                       ("**overhead while decoding**", "overhead_decoding"),
                       (f"**overhead after {NEW_LENGTHS} new prompt lengths**", "overhead_new_lengths")):
        lines.append(f"| {label} | " + " | ".join(f"{r[key] / MiB:.1f}" for r in ok) + " |")
    lines += by_part_table(ok)
    lines.append("")
    for r in ok:
        loaded = ", ".join(r["lazy_modules_loaded"]) or "none"
        lines.append(f"- {r['model']}: lazily imported modules loaded by the generation path: {loaded}")
    for r in results:
        if "error" in r:
            lines.append(f"- {r['model']}: failed: {r['error']}")
    return lines


OTHER_ANON = "other anonymous (pymalloc, numpy, mmapped malloc chunks, torch tensors)"


def split_parts(snapshot: dict) -> dict[str, int]:
    """A parts snapshot as table rows: the huge-page mappings less the weights they hold, Python's
    small-object arenas apart from the other anonymous memory."""
    by = dict(snapshot["by_part"])
    by.pop(HUGE, None)
    by["huge-page rounding (mapped beyond the weights in it)"] = snapshot["huge_rounding"]
    other = by.pop(OTHER_ANON, 0)
    by["Python objects (pymalloc arenas)"] = min(other, snapshot["pymalloc"])
    by["other anonymous (torch/numpy buffers, mmapped malloc chunks)"] = other - by["Python objects (pymalloc arenas)"]
    return by


def by_part_table(ok: list[dict]) -> list[str]:
    """The loaded engine's overhead by part (MiB), each with what it grew by since the generation path's imports."""
    if not ok or "parts_at_load" not in ok[0]:
        return []
    lines = ["", "## The overhead at load by part (MiB; in brackets: grown since the generation path's imports)", "",
             "| part | " + " | ".join(r["model"] for r in ok) + " |", "|---|" + "---:|" * len(ok)]
    loads = [split_parts(r["parts_at_load"]) for r in ok]
    starts = [split_parts(r["parts_at_imports"]) for r in ok]
    names = sorted({n for by in loads for n in by}, key=lambda n: -max(by.get(n, 0) for by in loads))
    for name in names:
        cells = [f"{by.get(name, 0) / MiB:.1f} ({(by.get(name, 0) - start.get(name, 0)) / MiB:+.1f})"
                 for by, start in zip(loads, starts, strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    outside = [r["dense_bytes"] + r["expert_bytes"] - r["parts_at_load"]["huge_weights"] for r in ok]
    lines.append("| less weights outside huge-page mappings (in: see below) | "
                 + " | ".join(f"{-o / MiB:.1f}" for o in outside) + " |")
    sums = [sum(by.values()) - o for by, o in zip(loads, outside, strict=True)]
    lines.append("| **sum of parts** (= VmRSS − weights) | " + " | ".join(f"**{t / MiB:.1f}**" for t in sums) + " |")
    lines.append("| unattributed (VmRSS − smaps' sum: the kernel's lazy counters) | " + " | ".join(
        f"{(r['parts_at_load']['rss'] - sum(r['parts_at_load']['by_part'].values())) / MiB:.1f}" for r in ok) + " |")
    lines.append("| where those weights lie (mapped bytes; a file's may be partly resident) | " + " | ".join(
        ", ".join(f"{n.split(' (')[0]} {v / MiB:.1f}" for n, v in r["parts_at_load"]["weights_in"].items()) or "—"
        for r in ok) + " |")
    heap = [r["parts_at_load"]["heap"] for r in ok]
    lines.append("| of glibc's heap: in use / free kept / mmapped chunks (mallinfo2) | " + " | ".join(
        f"{h.get('in_use', 0) / MiB:.1f} / {h.get('free', 0) / MiB:.1f} / {h.get('mmapped', 0) / MiB:.1f}"
        for h in heap) + " |")
    lines.append("| threads (of them with an 8 MiB pthread stack) | " + " | ".join(
        f"{r['parts_at_load']['threads']} ({r['parts_at_load']['thread_stacks']})" for r in ok) + " |")
    for label, key, scale in (("first forward's working set (peak − settled, freed)", "first_forward_working_set", MiB),
                              ("KV cache per 1k tokens (not held at load)", "kv_bytes_per_token", MiB / 1024),
                              ("expert staging buffers, bound (2 load threads × slot; none resident at `all`)",
                               "staging_bytes_bound", MiB)):
        lines.append(f"| {label} | " + " | ".join(f"{r[key] / scale:.1f}" for r in ok) + " |")
    lines.append("| Python modules imported | " + " | ".join(str(r["modules_imported"]) for r in ok) + " |")
    ends = [split_parts(r["parts_at_end"]) for r in ok]
    grown = [{n: by.get(n, 0) - load.get(n, 0) for n in by} for by, load in zip(ends, loads, strict=True)]
    lines.append(f"| after the {NEW_LENGTHS} new prompt lengths, grown: | " + " | ".join(
        ", ".join(f"{n.split(' (')[0]} {v / MiB:+.1f}" for n, v in g.items() if abs(v) >= MiB / 2) or "—"
        for g in grown) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,qwen3moe-mini", help="comma-separated: demo, a bench geometry, a folder")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = measure(args.child)
        print(json.dumps(result))
        return 0
    results = [run_child(m) for m in args.models.split(",") if m]
    write_report(args.out, "overhead", {"results": results}, table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
