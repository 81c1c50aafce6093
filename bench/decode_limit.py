"""Decode speed against the memory-bandwidth limit (issue 10), side by side in one run.

For each geometry: the limit = (bytes of weights one decode token reads) / (memory read
bandwidth measured now), our engine at budget `all`, and stock transformers with its best
experts implementation — 3 interleaved repetitions, median.

    python -m bench.decode_limit [--reps 3] [--prompt-len 128] [--decode 64] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.bandwidth import memory_read_bandwidth
from bench.output import RESULTS_DIR, result_stem
from bench.synthetic import build_checkpoint


def active_bytes_per_token(model_dir: Path) -> tuple[int, int]:
    """(bytes a decode token reads, expert bytes of those): every dense weight but the embedding
    table (one row), plus top-k experts per MoE layer."""
    from engine.inspect_model import inspect_checkpoint
    from engine.loader import build_model

    info = inspect_checkpoint(str(model_dir))
    loaded = build_model(str(model_dir), device=__import__("torch").device("meta"), load_dense=False)
    embed = loaded.model.get_input_embeddings().weight
    embed_bytes = embed.numel() * embed.element_size()
    experts = info.top_k * info.expert_bytes * info.num_moe_layers
    return info.dense_bytes - embed_bytes + experts, experts


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_measure(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.measure", *args], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_limit")
    parser.add_argument("--geometries", default="qwen3moe-64e,mixtral-8e")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    common = ["--prompt-len", str(args.prompt_len), "--decode", str(args.decode), "--threads", str(args.threads)]
    rows = []
    for name in args.geometries.split(","):
        path = build_checkpoint(name)
        active, _ = active_bytes_per_token(path)
        ours, fast, stock, bandwidth = [], [], [], []
        for _ in range(args.reps):  # interleaved, so drift in machine load hits every system alike
            bandwidth.append(memory_read_bandwidth(threads=args.threads))
            ours.append(run_measure("ours", "--model", str(path), "--budget", "all", "--store", "ram", *common))
            fast.append(run_measure("ours", "--model", str(path), "--budget", "all", "--store", "ram", "--fast-decode",
                                    *common))
            stock.append(run_measure("stock", "--model", str(path), *common))
        bw = statistics.median(bandwidth)
        limit = bw / active
        ours_tps = statistics.median(r["decode_tokens_per_s"] for r in ours)
        stock_tps = statistics.median(r["decode_tokens_per_s"] for r in stock)
        fast_tps = statistics.median(r["decode_tokens_per_s"] for r in fast)
        reference = stock[0]["token_ids"]
        rows.append({
            "geometry": name, "active_bytes_per_token": active, "bandwidth_bytes_per_s": bw,
            "limit_tokens_per_s": limit, "ours_tokens_per_s": ours_tps, "stock_tokens_per_s": stock_tps,
            "ours_over_limit": ours_tps / limit, "stock_over_limit": stock_tps / limit,
            "fast_tokens_per_s": fast_tps, "fast_over_limit": fast_tps / limit,
            "ours_same_tokens": all(r["token_ids"] == reference for r in ours),
            "fast_same_tokens_prefix": min(same_prefix(r["token_ids"], reference) for r in fast),
            "fast_prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in fast),
            "ours_prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in ours),
            "stock_prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in stock),
            "reps": {"ours": ours, "fast": fast, "stock": stock, "bandwidth": bandwidth},
        })
        print(f"{name}: limit {limit:.1f} tok/s, ours {ours_tps:.1f}, ours --fast-decode {fast_tps:.1f}, "
              f"stock {stock_tps:.1f}, ours/limit {ours_tps / limit:.2f}, fast/limit {fast_tps / limit:.2f}", flush=True)
    write_results(rows, args)
    return 0


def write_results(rows: list[dict], args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("decode-limit")
    (args.out / f"{stem}.json").write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))
    lines = [
        f"Decode vs the memory-bandwidth limit — {args.threads} threads, bf16, batch 1, {args.prompt_len}-token prompt, "
        f"{args.decode} decode tokens, median of {args.reps} interleaved runs.",
        "",
        "| geometry | active MB/token | read GB/s | limit tok/s | MoEScope tok/s | MoEScope --fast-decode tok/s "
        "| transformers tok/s | MoEScope/limit | fast-gemv/limit | transformers/limit | same tokens as transformers "
        "(default / fast-gemv) | prefill MoEScope / fast-gemv / transformers tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = len(r["reps"]["stock"][0]["token_ids"])
        lines.append(
            f"| {r['geometry']} | {r['active_bytes_per_token'] / 1e6:.0f} | {r['bandwidth_bytes_per_s'] / 1e9:.1f} | "
            f"{r['limit_tokens_per_s']:.1f} | {r['ours_tokens_per_s']:.1f} | {r['fast_tokens_per_s']:.1f} | "
            f"{r['stock_tokens_per_s']:.1f} | {r['ours_over_limit']:.2f} | {r['fast_over_limit']:.2f} | "
            f"{r['stock_over_limit']:.2f} | {'all' if r['ours_same_tokens'] else 'no'} / "
            f"{r['fast_same_tokens_prefix']} of {n} | {r['ours_prefill_tokens_per_s']:.0f} / "
            f"{r['fast_prefill_tokens_per_s']:.0f} / {r['stock_prefill_tokens_per_s']:.0f} |"
        )
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
