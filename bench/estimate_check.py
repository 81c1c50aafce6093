"""`python -m bench.estimate_check [--models demo,qwen3moe-64e,mixtral-8e] [--budgets 25%,all] [--out DIR]`:
the peak resident memory the fit estimate predicts for a run against the one measured (issue 62).

Each model at each budget runs in a fresh process: the load and a short reply (a 16-token prompt,
16 new tokens, greedy), then its peak RSS (VmHWM, kept across the runtime's phase resets:
engine.system.memory.peak_rss_bytes). The estimate is engine.hub.footprint.run_footprint on the
folder's size estimate, for the same budget and context used. Tiny qwen3-MoE checkpoints that differ
only in their number of layers or of experts per layer give the bookkeeping per layer and per expert
(engine.hub.footprint's PER_LAYER and PER_EXPERT). Writes bench/results/estimate-check-<host>-<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

MiB = 1024**2
PROMPT_TOKENS, NEW_TOKENS = 16, 16
GOAL = 0.05  # within 5 % either way
TINY = {"tiny-4l-8e": (4, 8), "tiny-4l-256e": (4, 256), "tiny-32l-8e": (32, 8)}  # layers, experts per layer


def measure(path: str, budget: str) -> dict:
    """In this (fresh) process: a load at `budget` and a short reply; the peak and the parts."""
    import torch

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.process import worker  # noqa: F401  (the engine process's own imports)
    from engine.protocol import LoadModel, SamplingSettings
    from engine.system import memory

    torch.set_num_threads(2)
    baseline = memory.baseline_rss_bytes()
    runtime = MoERuntime(LoadModel(path=path, budget=budget))
    load_peak = memory.peak_rss_bytes()
    vocab = runtime.model.config.get_text_config().vocab_size
    Generator(runtime).generate([3 + i % (vocab - 3) for i in range(PROMPT_TOKENS)],
                                SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
    return {"baseline": baseline, "load_peak": load_peak, "peak": memory.peak_rss_bytes(),
            "dense": runtime.overhead.dense_bytes, "budget_bytes": runtime.plan.budget_bytes}


def estimate(path: str, budget: str) -> dict:
    from engine.hub.estimate import estimate_folder
    from engine.hub.footprint import run_footprint

    est = estimate_folder(Path(path))
    fp = run_footprint(est, budget, context_tokens=PROMPT_TOKENS + NEW_TOKENS, prompt_tokens=PROMPT_TOKENS)
    return {"peak": fp.peak, "load_peak": fp.load_peak, "engine": fp.engine, "parts": dict(fp.parts())}


def model_path(name: str) -> str:
    from bench.synthetic import GEOMETRIES, build_checkpoint
    from engine.hub.local import resolve_model

    return str(build_checkpoint(name)) if name in GEOMETRIES else str(resolve_model(name))


def tiny_checkpoint(root: Path, layers: int, experts: int) -> str:
    """A qwen3-MoE checkpoint small enough that only its counts of layers and experts show."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                  num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    folder = root / f"tiny-{layers}l-{experts}e"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


def run_child(name: str, path: str, budget: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.estimate_check", "--child", path, budget],
                          capture_output=True, text=True, timeout=1800)
    row = {"model": name, "budget": budget}
    if proc.returncode != 0:
        return row | {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    return row | {"measured": measured, "estimate": estimate(path, budget)}


def table(rows: list[dict]) -> list[str]:
    lines = ["# Estimated vs measured peak RSS of a run (load + a 16-token prompt, 16 new tokens; MiB)", "",
             "| model | budget | estimate | measured | estimate / measured | engine's own, estimated | "
             "engine's own, measured | within 5 % |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['budget']} | failed: {r['error']} ||||||")
            continue
        est, got = r["estimate"], r["measured"]
        own = got["peak"] - got["dense"] - got["budget_bytes"]
        ratio = est["peak"] / got["peak"]
        lines.append(f"| {r['model']} | {r['budget']} | {est['peak'] / MiB:.1f} | {got['peak'] / MiB:.1f} | "
                     f"{ratio:.3f} | {est['engine'] / MiB:.1f} | {own / MiB:.1f} | "
                     f"{'yes' if abs(ratio - 1) <= GOAL else '**no**'} |")
    return lines


def derivation(rows: list[dict]) -> list[str]:
    """PER_LAYER and PER_EXPERT from the tiny checkpoints' engine-own peaks."""
    own = {r["model"]: r["measured"]["peak"] - r["measured"]["dense"] - r["measured"]["budget_bytes"]
           for r in rows if "error" not in r}
    if not all(name in own for name in TINY):
        return []
    base = own["tiny-4l-8e"]
    per_expert = (own["tiny-4l-256e"] - base) / (4 * (256 - 8))
    per_layer = (own["tiny-32l-8e"] - base - per_expert * 8 * (32 - 4)) / (32 - 4)
    return ["", "## Bookkeeping from the tiny checkpoints (engine's own memory at the peak)", "",
            "| tiny checkpoint | engine's own (MiB) |", "|---|---:|",
            *[f"| {name} | {own[name] / MiB:.1f} |" for name in TINY],
            f"| per routed expert | {per_expert:.0f} B |", f"| per layer (beyond its experts) | {per_layer / 1024:.0f} KiB |"]


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,qwen3moe-64e,mixtral-8e")
    parser.add_argument("--budgets", default="25%,all")
    parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the tiny checkpoints the bookkeeping figures come from")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child)))
        return 0
    rows = [run_child(m, model_path(m), b) for m in args.models.split(",") if m for b in args.budgets.split(",")]
    extra: list[dict] = []
    if args.tiny:
        with tempfile.TemporaryDirectory() as root:
            extra = [run_child(n, tiny_checkpoint(Path(root), *shape), "all") for n, shape in TINY.items()]
    write_report(args.out, "estimate-check", {"rows": rows, "tiny": extra}, table(rows) + derivation(extra))
    return 0 if all("error" not in r for r in rows + extra) else 1


if __name__ == "__main__":
    sys.exit(main())
