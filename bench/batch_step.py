"""Replies decoding together in one whole-token step, in-process: how a step of N tokens (N replies)
compares with N steps of one, and with the bound the bytes it reads set.

On the Q4_K_M GGUF of a bench geometry (bench.gguf_files; qwen3moe-64e by default), budget `all`,
`--threads` threads: `--replies` replies are prefilled, then decode `--tokens` tokens each, once
one reply per step and once all in one step (`WholeTokenStep.step_rows`), interleaved, the order
flipped every repetition. Printed and written: tokens/s of each as a ratio (together / one at a
time, medians of the repetitions' ratios), and the bound: the bytes one step of N reads (dense
weights once, the union of their experts from the routing they took) against N steps of one.

    python -m bench.batch_step [--geometry qwen3moe-64e] [--replies 4] [--tokens 32] [--repetitions 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

KIND = "batch-step"


def _prompts(replies: int, length: int = 16) -> list[list[int]]:
    return [[(97 * r + 13 * i + 5) % 1000 + 10 for i in range(length)] for r in range(replies)]


def _prefilled(runtime, prompts: list[list[int]]) -> tuple[list, list[int]]:
    """A KV cache per prompt, and each reply's first token (greedy)."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.model.cache_argument import cache_argument

    caches, tokens = [], []
    with torch.inference_mode():
        for prompt in prompts:
            cache = new_cache(runtime.model)
            out = runtime.model(input_ids=torch.tensor([prompt]), **cache_argument(runtime.model, cache),
                                use_cache=True)
            caches.append(cache)
            tokens.append(int(out.logits[0, -1].argmax()))
    return caches, tokens


def _decode(decoder, caches: list, tokens: list[int], steps: int, together: bool) -> tuple[float, list]:
    """Seconds for `steps` tokens of every reply, and the experts each step ran ([rows, layers, k] each)."""
    import torch

    picks = []
    tokens = list(tokens)
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(steps):
            if together:
                logits, experts = decoder.step_rows(tokens, caches)
                picks.append(experts)
                tokens = [int(row[0, -1].argmax()) for row in logits]
            else:
                tokens = [int(decoder.step(t, kv)[0, -1].argmax()) for t, kv in zip(tokens, caches, strict=True)]
        return time.perf_counter() - started, picks


def _bound(gguf: Path, picks: list) -> dict:
    """The bytes one step of N reads (dense weights once, each expert of the union once, from the GGUF's
    tensors: bench.gguf_files) against N steps of one, with the union the steps took."""
    import numpy as np

    from bench.gguf_files import gguf_token_bytes
    from bench.serve_load import batching_bound

    token = gguf_token_bytes(gguf)
    rows, layers, top_k = picks[0].shape
    dense = token.bytes_per_token - token.expert_bytes_per_token
    expert = token.expert_bytes_per_token / top_k  # one expert in every MoE layer
    union = statistics.mean(len(np.unique(step[:, layer])) for step in picks for layer in range(layers))
    return {"union_per_layer": union, "step_bytes": dense + union * expert,
            "one_token_bytes": dense + top_k * expert, "bound": batching_bound(dense, expert, top_k, union, rows)}


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.batch_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3moe-64e", help="a bench.synthetic geometry")
    parser.add_argument("--replies", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="tokens each reply decodes per measurement")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch and the kernels start their threads
    import torch

    from bench.gguf_files import ensure_ggufs
    from bench.llamacpp_build import build_tools
    from bench.synthetic import build_checkpoint
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel

    torch.set_num_threads(args.threads)
    gguf = ensure_ggufs(build_checkpoint(args.geometry), ("Q4_K_M",), lc=build_tools())["Q4_K_M"]
    runtime = MoERuntime(LoadModel(path=str(gguf), budget="all", store="ram"))
    decoder = runtime.whole_token.decoder
    ratios, picks = [], []
    for repetition in range(args.repetitions):
        seconds = {}
        for together in ((False, True) if repetition % 2 == 0 else (True, False)):
            caches, tokens = _prefilled(runtime, _prompts(args.replies))
            seconds[together], ran = _decode(decoder, caches, tokens, args.tokens, together)
            picks += ran
        ratios.append(seconds[False] / seconds[True])
        rate = args.replies * args.tokens / seconds[False]
        print(f"rep {repetition + 1}: one at a time {rate:.1f} tok/s, together {ratios[-1]:.2f}x", flush=True)
    b = _bound(gguf, picks)
    gain = statistics.median(ratios)
    runtime.close()
    n = args.replies
    lines = [f"{n} replies in one whole-token step: {args.geometry} Q4_K_M GGUF, budget all, {args.threads} "
             f"threads, {args.tokens} tokens a reply, medians of {args.repetitions} interleaved repetitions "
             "(`python -m bench.batch_step`).", "",
             "| | tokens/s relative to one reply per step |", "|---|---|",
             "| one reply per step | 1.00 |", f"| {n} replies in one step | {gain:.2f} |",
             f"| bound: bytes of {n} steps of one / bytes of one step of {n} | {b['bound']:.2f} |", "",
             f"Reached {gain / b['bound']:.2f} of the bound. A step of {n} reads {b['step_bytes'] / 1e6:.0f} MB "
             f"(dense once, the union of their experts: {b['union_per_layer']:.1f} a layer); one token "
             f"{b['one_token_bytes'] / 1e6:.0f} MB."]
    write_report(args.out, KIND, {"gain": gain, "ratios": ratios, **b}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
