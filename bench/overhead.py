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
Also lists the modules the generation path imports that it need not (the cut ones stay cut:
tests/test_overhead.py). Writes bench/results/overhead-<host>-<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
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
    lazy_loaded = [name for name in LAZY if name in sys.modules]
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
    overhead = runtime.overhead
    generator = Generator(runtime)
    prompt = list(range(3, 19))
    generator.generate(prompt, SamplingSettings(temperature=0, max_new_tokens=DECODE_TOKENS))
    points[f"after {DECODE_TOKENS} decode tokens"] = rss()
    for length in range(2, 2 + NEW_LENGTHS):
        generator.generate(list(range(3, 3 + length)), SamplingSettings(temperature=0, max_new_tokens=4))
    release_free_heap()  # what stays is kept on purpose (caches), not a long prompt's freed activations
    points[f"after {NEW_LENGTHS} prompts of new lengths, heap trimmed"] = rss()
    in_memory = overhead.dense_bytes + runtime.layout.all_expert_bytes  # every expert is resident at `all`
    return {
        "model": model, "points": points, "dense_bytes": overhead.dense_bytes,
        "expert_bytes": runtime.layout.all_expert_bytes, "baseline_bytes": overhead.baseline_bytes,
        "overhead_at_load": overhead.total_bytes, "overhead_decoding": points[f"after {DECODE_TOKENS} decode tokens"] - in_memory,
        "overhead_new_lengths": points[f"after {NEW_LENGTHS} prompts of new lengths, heap trimmed"] - in_memory,
        "lazy_modules_loaded": lazy_loaded,
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
    lines.append("")
    for r in ok:
        loaded = ", ".join(r["lazy_modules_loaded"]) or "none"
        lines.append(f"- {r['model']}: lazily imported modules loaded by the generation path: {loaded}")
    for r in results:
        if "error" in r:
            lines.append(f"- {r['model']}: failed: {r['error']}")
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
