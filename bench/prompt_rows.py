"""A short prompt as the rows of one whole-token step against the fast prompt path, in one process,
beside llama.cpp's prompt speed at the same lengths.

On the Q4_K_M GGUF of a bench geometry (bench.gguf_files; qwen3moe-64e by default) or `--model`,
budget `all`, `--threads` threads: for each prompt length, a fresh prompt of random token ids runs
into an empty KV cache once as rows of the step (`WholeTokenStep.step_prompt`, the whole-token
path's way for prompts of up to its 64 rows) and once on the fast prompt path (`NativePromptPath`,
the model's forward with the prompt's experts on native rows), interleaved, the order flipped every
repetition. Printed and written: milliseconds of each (medians), the prompt path's time over the
rows' (median of the per-repetition ratios), and llama.cpp's prompt time (`llama-bench -p N -n 0`,
medians of its repetitions; run between ours) where it is built, for the GGUF.

    python -m bench.prompt_rows [--lengths 8,16,32,64] [--repetitions 9] [--skip-llamacpp] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

KIND = "prompt-rows"


def llama_prompt_ms(tool: Path, gguf: Path, length: int, threads: int, repetitions: int) -> float:
    """llama-bench's prompt time for `length` tokens (ms, the mean over its repetitions)."""
    proc = subprocess.run([str(tool), "-m", str(gguf), "-t", str(threads), "-p", str(length), "-n", "0",
                           "-r", str(repetitions), "-lm", "none", "-o", "json"], capture_output=True, text=True, check=True)
    row = json.loads(proc.stdout)[0]
    return 1e3 * length / row["avg_ts"]


def measure(runtime, lengths: list[int], repetitions: int, llama=None) -> list[dict]:
    """Per length: the rows' and the prompt path's milliseconds, their ratio, and llama.cpp's."""
    import torch

    from bench.measure import prompt_ids
    from engine.decode.kv_cache import expect_positions, new_cache
    from engine.decode.paths.base import Step
    from engine.decode.paths.native_layers import NativePromptPath

    rows_path = runtime.whole_token
    prompt_path = next(path for path in runtime.paths.paths if isinstance(path, NativePromptPath))
    vocab = runtime.model.config.vocab_size
    out = []
    with torch.inference_mode():
        for length in lengths:
            times: dict[str, list[float]] = {"rows": [], "prompt path": []}
            reason = ""
            for rep in range(repetitions + 1):  # the first is a warm-up
                ids = prompt_ids(vocab, length, seed=rep)
                for way in ("rows", "prompt path") if rep % 2 else ("prompt path", "rows"):
                    kv = new_cache(runtime.model)
                    expect_positions(kv, length)
                    step = Step(torch.tensor([ids]), kv, 0)
                    path = rows_path if way == "rows" else prompt_path
                    if (why := path.unavailable(step)) is not None:
                        reason = f"{way}: {why}"
                        continue
                    started = time.perf_counter()
                    path.run(step)
                    if rep:
                        times[way].append(time.perf_counter() - started)
            row = {"length": length, "unavailable": reason}
            if not reason:
                row.update({f"{way}_ms": 1e3 * statistics.median(t) for way, t in times.items()})
                row["prompt_path_over_rows"] = statistics.median(
                    p / r for p, r in zip(times["prompt path"], times["rows"], strict=True))
            if llama is not None:
                row["llamacpp_ms"] = llama(length)
            out.append(row)
            print(row, flush=True)
    return out


def report(result: dict) -> list[str]:
    lines = [f"A prompt as rows of the whole-token step against the fast prompt path: {result['model']}, budget all, "
             f"{result['threads']} threads, medians of {result['repetitions']} interleaved repetitions "
             "(`python -m bench.prompt_rows`).", "",
             "| prompt tokens | as rows (ms) | prompt path (ms) | prompt path / rows | llama.cpp (ms) |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        llama = f"{r['llamacpp_ms']:.1f}" if "llamacpp_ms" in r else "n/a"
        if r["unavailable"]:
            lines.append(f"| {r['length']} | n/a ({r['unavailable']}) | | | {llama} |")
        else:
            lines.append(f"| {r['length']} | {r['rows_ms']:.1f} | {r['prompt path_ms']:.1f} | "
                         f"{r['prompt_path_over_rows']:.2f} | {llama} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3moe-64e", help="a bench.synthetic geometry (its Q4_K_M GGUF)")
    parser.add_argument("--model", help="any model MoEScope opens instead (llama.cpp is then left out)")
    parser.add_argument("--lengths", default="8,16,32,64")
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch and the kernels start their threads
    import torch

    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel

    torch.set_num_threads(args.threads)
    llama = None
    if args.model:
        model = args.model
    else:
        from bench.gguf_files import ensure_ggufs
        from bench.llamacpp_build import LlamaCppUnavailable, build_tools
        from bench.synthetic import build_checkpoint

        try:
            lc = build_tools()
        except LlamaCppUnavailable as e:
            print(f"error: {e} (--model PATH measures MoEScope alone)", file=sys.stderr)
            return 2
        gguf = ensure_ggufs(build_checkpoint(args.geometry), ("Q4_K_M",), lc=lc)["Q4_K_M"]
        model = str(gguf)
        if not args.skip_llamacpp:
            def llama(length: int) -> float:
                return llama_prompt_ms(lc.tool("llama-bench"), gguf, length, args.threads, 3)
    # a checkpoint in bf16 (the fast paths' dtype); a GGUF's dense weights load so anyway
    runtime = MoERuntime(LoadModel(path=model, budget="all", store="ram", **({"dtype": "bfloat16"} if args.model else {})))
    try:
        rows = measure(runtime, [int(n) for n in args.lengths.split(",")], args.repetitions, llama)
    finally:
        runtime.close()
    label = args.model or f"{args.geometry} Q4_K_M GGUF"
    result = {"model": label, "threads": args.threads, "repetitions": args.repetitions, "rows": rows}
    write_report(args.out, KIND, result, report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
