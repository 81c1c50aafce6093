"""Prefill speed, MoEScope against stock transformers, in one process with alternating prompts.

Separate processes run at whatever memory bandwidth and core placement the host gives at that
moment (on the 2-core VM both jump for seconds at a time), so decode_limit's per-process prefill
medians can land either way. Here both models sit in one process and take turns on the same
prompts: each side's forward is called as its own generate loop calls it (ours with the index
form of logits_to_keep, engine.decode.runtime.last_position; transformers with logits_to_keep=1).

    python -m bench.prefill_pair [--geometries qwen3moe-64e,mixtral-8e] [--prompt-len 128] [--turns 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.measure import prompt_ids
from bench.output import RESULTS_DIR, write_report
from bench.synthetic import build_checkpoint
from engine.system.process_settings import apply_process_settings


def pair(path: Path, prompt_len: int, turns: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.transformers_path import last_position
    from engine.decode.runtime import MoERuntime
    from engine.model.cache_argument import cache_argument
    from engine.protocol import LoadModel

    torch.set_num_threads(threads)
    ours = MoERuntime(LoadModel(path=str(path), budget="all", store="ram"))
    stock = AutoModelForCausalLM.from_pretrained(path, dtype="auto", experts_implementation="grouped_mm")
    ids = torch.tensor([prompt_ids(stock.config.get_text_config().vocab_size, prompt_len)])
    mask = torch.ones_like(ids)

    def run_ours() -> None:
        ours.model(input_ids=ids, **cache_argument(ours.model, new_cache(ours.model)), use_cache=True,
                   logits_to_keep=last_position(ids))

    def run_stock() -> None:
        stock(input_ids=ids, attention_mask=mask, **cache_argument(stock, DynamicCache(config=stock.config)), use_cache=True,
              logits_to_keep=1)

    seconds: dict[str, list[float]] = {"ours": [], "stock": []}
    with torch.inference_mode():
        run_ours(), run_stock()  # warm-up
        for turn in range(turns):
            for name, run in (("ours", run_ours), ("stock", run_stock))[:: 1 if turn % 2 == 0 else -1]:
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
    ours.close()
    per_turn = [s / o for o, s in zip(seconds["ours"], seconds["stock"], strict=True)]
    return {
        "geometry": path.name, "prompt_len": prompt_len, "turns": turns,
        "ours_tokens_per_s": prompt_len / statistics.median(seconds["ours"]),
        "stock_tokens_per_s": prompt_len / statistics.median(seconds["stock"]),
        "ours_over_stock": statistics.median(per_turn),
        "turns_ours_faster": sum(r > 1 for r in per_turn),
        "seconds": seconds,
    }


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_pair")
    parser.add_argument("--geometries", default="qwen3moe-64e,mixtral-8e")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    rows = [pair(Path(name) if Path(name).is_dir() else build_checkpoint(name),  # a geometry or a folder
                 args.prompt_len, args.turns, args.threads) for name in args.geometries.split(",")]
    lines = [
        f"Prefill, MoEScope (exact, budget all) vs transformers (grouped_mm), one process, {args.threads} threads, "
        f"{args.prompt_len}-token prompt, {args.turns} alternating turns each (medians; ratio = median of the "
        "turns' ratios).",
        "",
        "| geometry | MoEScope tok/s | transformers tok/s | MoEScope / transformers | turns MoEScope was faster |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['geometry']} | {r['ours_tokens_per_s']:.0f} | {r['stock_tokens_per_s']:.0f} | "
                     f"{r['ours_over_stock']:.2f} | {r['turns_ours_faster']} of {r['turns']} |")
    write_report(args.out, "prefill-pair", {"threads": args.threads, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
