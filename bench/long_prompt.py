"""`python -m bench.long_prompt [--models qwen3moe-64e,mixtral-8e] [--repetitions 3]`: a long prompt's
memory and prefill speed, its prompt in 512-token chunks (the engine's way) beside all at once.

Each run is a fresh process that loads the model at budget `all` and reads a 512-token prompt, then
an 8,192-token one (two new tokens each); it reports the peak resident memory (VmHWM) after each and
the prefill rate. The bench checkpoints are copied as a 32k-context variant (their weights linked,
the config's context raised), with Q4_K experts. The goal: peak after 8,192 <= peak after 512 + the
KV cache's bytes for 8,192 tokens + 64 MiB, and chunked prefill as fast as whole within noise (runs
alternate, chunked then whole, and the rate ratio is the median of each repetition's).
Writes bench/results/long-prompt-<host>-<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

MiB = 1024**2
SHORT, LONG = 512, 8192
WHOLE = 1 << 30  # a chunk no prompt reaches: the prompt in one forward
SLACK = 64 * MiB
CACHE = Path(__file__).resolve().parent / "cache"


def peak_bytes() -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:"))


def prompt_of(n: int, vocab: int) -> list[int]:
    return [(7 * i + 3) % (vocab - 1) + 1 for i in range(n)]


def measure(path: str, chunk: int, expert_format: str = "original", dtype: str = "auto",
            fast: bool = True) -> dict:
    """In this process: the model loaded at `all`, a 512- then an 8,192-token prompt read in chunks of
    `chunk`; the peak after each, the long prompt's prefill rate and the KV cache's bytes for it."""
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.hub.estimate import kv_cache_bytes_per_token
    from engine.protocol import LoadModel, SamplingSettings

    runtime = MoERuntime(LoadModel(path=path, budget="all", store="ram", expert_format=expert_format,
                                   dtype=dtype, fast_decode=fast))
    runtime.prefill_chunk_tokens = chunk
    generator = Generator(runtime)
    vocab = runtime.model.config.get_text_config().vocab_size
    result: dict = {"chunk": chunk}
    for n in (SHORT, LONG):
        reply = generator.generate(prompt_of(n, vocab), SamplingSettings(temperature=0, max_new_tokens=2))
        result[f"peak_{n}"] = peak_bytes()
        result[f"prefill_tokens_per_s_{n}"] = reply.stats.prefill_tokens_per_s
    itemsize = runtime.dtype.itemsize
    result["kv_bytes"] = kv_cache_bytes_per_token(runtime.model.config, itemsize) * LONG
    runtime.close()
    return result


def measure_in_child(path: str, chunk: int, expert_format: str = "original", dtype: str = "auto") -> dict:
    """`measure` in a fresh process (its peak is the run's alone)."""
    out = subprocess.run([sys.executable, "-m", "bench.long_prompt", "--child", path, "--chunk", str(chunk),
                          "--expert-format", expert_format, "--dtype", dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def growth(result: dict) -> int:
    """The long prompt's peak beyond the short one's."""
    return result[f"peak_{LONG}"] - result[f"peak_{SHORT}"]


def long_context_copy(name: str, context: int = 32768) -> Path:
    """The bench checkpoint `name` as a `context`-token model: its files linked, its config's context raised."""
    source = CACHE / f"{name}-bfloat16"
    target = CACHE / f"{name}-bfloat16-ctx{context}"
    target.mkdir(exist_ok=True)
    for item in source.iterdir():
        link = target / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = context
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def run_model(name: str, repetitions: int, expert_format: str) -> dict:
    path = str(long_context_copy(name))
    runs: dict[str, list[dict]] = {"chunked": [], "whole": []}
    for _ in range(repetitions):  # alternating, so a swing of the machine's speed meets both alike
        runs["chunked"].append(measure_in_child(path, 512, expert_format))
        runs["whole"].append(measure_in_child(path, WHOLE, expert_format))
    rate_ratio = statistics.median(c[f"prefill_tokens_per_s_{LONG}"] / w[f"prefill_tokens_per_s_{LONG}"]
                                   for c, w in zip(runs["chunked"], runs["whole"], strict=True))
    return {"model": name, "expert_format": expert_format, "runs": runs, "prefill_rate_chunked_over_whole": rate_ratio}


def table(models: list[dict]) -> list[str]:
    lines = ["| model | prefill | peak after 512 (MiB) | after 8,192 | growth | KV cache 8,192 | bound (KV + 64) | "
             "within | prefill rate, chunked / whole |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for m in models:
        for mode, runs in m["runs"].items():
            short = statistics.median(r[f"peak_{SHORT}"] for r in runs) / MiB
            long = statistics.median(r[f"peak_{LONG}"] for r in runs) / MiB
            grown = statistics.median(growth(r) for r in runs) / MiB
            kv = runs[0]["kv_bytes"] / MiB
            bound = kv + SLACK / MiB
            ratio = f"{m['prefill_rate_chunked_over_whole']:.2f}" if mode == "chunked" else ""
            lines.append(f"| {m['model']} ({m['expert_format']}) | {mode} | {short:.0f} | {long:.0f} | {grown:.0f} | "
                         f"{kv:.0f} | {bound:.0f} | {'yes' if grown <= bound else 'no'} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3moe-64e,mixtral-8e")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--expert-format", default="q4_k")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.chunk, args.expert_format, args.dtype)))
        return 0
    models = [run_model(name, args.repetitions, args.expert_format) for name in args.models.split(",")]
    lines = [f"Peak resident memory (VmHWM, median of {args.repetitions}) at budget `all`, 2 new tokens per prompt; "
             "runs alternate chunked / whole.", "", *table(models)]
    write_report(args.out, "long-prompt", {"models": models, "slack_bytes": SLACK}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
