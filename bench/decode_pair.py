"""Decode against the memory-bandwidth limit, token by token: each decode token is followed by a
pure read of as many bytes as a token reads, and the two are set side by side.

On the 2-core VM the memory bandwidth jumps between two levels for seconds at a time, so a limit
measured seconds away from a run (bench.decode_limit) can belong to the other level. Here the
limit is measured between every two tokens of the same reply: for token i, t_i is the time the
token took and r_i the time a float32 sum over `active bytes per token` took right after it (in
2 MiB pages, like the weights). The share of the limit is sum(r_i) / sum(t_i): how long the
tokens would have taken at the bandwidth of their own moments, over how long they took. The
read between tokens also evicts the caches, so each token starts colder than in a plain reply:
if anything, this flatters the limit.

Stock transformers is measured the same way, the read done in its streamer's callback. Greedy
tokens are compared with transformers' default attention and, in one more run whose times are not
reported, with its eager attention: the two can part at a near-tie (DeepSeek-V3-shaped at token 57, where eager's two best
logits are the same bf16 value), and no other summation order can then equal both.

    python -m bench.decode_pair [--geometries qwen3moe-64e,mixtral-8e] [--decode 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from bench.format_settings import active_bytes_per_token
from bench.measure import prompt_ids
from bench.output import RESULTS_DIR, write_report
from bench.synthetic import build_checkpoint
from engine.system.process_settings import apply_process_settings


class TokenAndRead:
    """Timestamps tokens, and after each one reads `nbytes` once and times that read; the read's
    time is left out of the next token's time."""

    def __init__(self, nbytes: int) -> None:
        import torch

        from engine.system import huge_pages

        self.buffer = huge_pages.empty((nbytes // 4,), torch.float32)
        self.buffer.fill_(1.0)
        self.token_s: list[float] = []
        self.read_s: list[float] = []
        self._since = 0.0

    def start(self) -> None:
        self._since = time.perf_counter()

    def token(self, *_args) -> None:
        now = time.perf_counter()
        self.token_s.append(now - self._since)
        self.buffer.sum()
        self._since = time.perf_counter()
        self.read_s.append(self._since - now)

    def share(self) -> float:
        # the first token is the prompt's (prefill): left out
        return sum(self.read_s[1:]) / sum(self.token_s[1:])


def run_ours(path: Path, active: int, args, fast: bool) -> dict:
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    # the disk store, as `auto` picks on a CPU: at `all` the load fills every slot from it, and the RAM
    # store would hold a second copy of the experts beside the slots
    runtime = MoERuntime(LoadModel(path=str(path), budget="all", store="disk", fast_decode=fast))
    ids = prompt_ids(runtime.model.config.get_text_config().vocab_size, args.prompt_len)
    generator = Generator(runtime)
    generator.generate(ids[:8], SamplingSettings(temperature=0, max_new_tokens=2))  # warm-up
    clock = TokenAndRead(active)
    clock.start()  # the first on_token call ends the prompt's step
    result = generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=args.decode), on_token=clock.token)
    runtime.close()
    del runtime, generator
    gc.collect()  # the model and the cache refer to each other: free them before the next run loads
    return {"share": clock.share(), "token_ids": result.token_ids,
            "tokens_per_s": (len(clock.token_s) - 1) / sum(clock.token_s[1:]),
            "limit_tokens_per_s": (len(clock.read_s) - 1) / sum(clock.read_s[1:])}


def run_stock(path: Path, active: int, args, attention: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    chosen = {"attn_implementation": attention} if attention else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", experts_implementation="grouped_mm", **chosen)
    used = model.config._attn_implementation  # the model's default when none was asked for
    ids = torch.tensor([prompt_ids(model.config.get_text_config().vocab_size, args.prompt_len)])
    clock = TokenAndRead(active)

    class Streamer:  # generate() calls put() with the prompt first, then once per token
        calls = 0

        def put(self, _value) -> None:
            if self.calls:
                clock.token()
            else:
                clock.start()
            self.calls += 1

        def end(self) -> None:
            pass

    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), do_sample=False, max_new_tokens=2,
                       pad_token_id=0)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.decode,
                             min_new_tokens=args.decode, streamer=Streamer(), pad_token_id=0)
    del model
    gc.collect()
    return {"share": clock.share(), "token_ids": out[0, ids.shape[1]:].tolist(), "attention": used,
            "tokens_per_s": (len(clock.token_s) - 1) / sum(clock.token_s[1:]),
            "limit_tokens_per_s": (len(clock.read_s) - 1) / sum(clock.read_s[1:])}


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.decode_pair")
    parser.add_argument("--geometries", default="qwen3moe-64e,mixtral-8e")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.geometries.split(","):
        path = Path(name) if Path(name).is_dir() else build_checkpoint(name)  # a geometry or a folder
        active = active_bytes_per_token(path)[0]
        runs: dict[str, list[dict]] = {"exact": [], "fast": [], "stock": []}
        for _ in range(args.reps):  # interleaved, as in decode_limit
            runs["exact"].append(run_ours(path, active, args, fast=False))
            runs["fast"].append(run_ours(path, active, args, fast=True))
            runs["stock"].append(run_stock(path, active, args))
        reference = runs["stock"][0]["token_ids"]
        eager = reference if runs["stock"][0]["attention"] == "eager" else run_stock(path, active, args, "eager")["token_ids"]
        row = {"geometry": name, "active_bytes_per_token": active, "runs": runs, "stock_attention": runs["stock"][0]["attention"],
               "eager_token_ids": eager}
        for mode, mode_runs in runs.items():
            row[f"{mode}_share"] = statistics.median(r["share"] for r in mode_runs)
            row[f"{mode}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in mode_runs)
            row[f"{mode}_same_tokens"] = all(r["token_ids"] == reference for r in mode_runs)
            row[f"{mode}_same_tokens_eager"] = all(r["token_ids"] == eager for r in mode_runs)
        rows.append(row)
        print(f"{name}: share of the limit, token by token: exact {row['exact_share']:.2f}, "
              f"fast {row['fast_share']:.2f}, transformers {row['stock_share']:.2f}", flush=True)
    lines = [
        f"Decode against the memory-bandwidth limit, token by token — {args.threads} threads, bf16, budget all, "
        f"{args.prompt_len}-token prompt, {args.decode} decode tokens, median of {args.reps} interleaved runs. After "
        "every token, a float32 sum over as many bytes as a token reads (2 MiB pages); share = sum of the reads' "
        "times / sum of the tokens' times.",
        "",
        "| geometry | active MB/token | MoEScope exact: share (tok/s) | MoEScope --fast-decode: share (tok/s) "
        "| transformers: share (tok/s) | same greedy tokens as transformers, its default / eager attention: "
        "exact; fast |",
        "|---|---|---|---|---|---|",
    ]

    def same(r: dict, mode: str) -> str:
        return " / ".join("yes" if r[key] else "no" for key in (f"{mode}_same_tokens", f"{mode}_same_tokens_eager"))

    for r in rows:
        lines.append(
            f"| {r['geometry']} | {r['active_bytes_per_token'] / 1e6:.0f} | {r['exact_share']:.2f} "
            f"({r['exact_tokens_per_s']:.1f}) | {r['fast_share']:.2f} ({r['fast_tokens_per_s']:.1f}) | "
            f"{r['stock_share']:.2f} ({r['stock_tokens_per_s']:.1f}, {r['stock_attention']}) | "
            f"{same(r, 'exact')}; {same(r, 'fast')} |")
    write_report(args.out, "decode-pair", {"threads": args.threads, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
