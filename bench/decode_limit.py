"""Decode speed against the memory-bandwidth limit (issue 10), side by side in one run.

For each geometry: the limit = (bytes of weights one decode token reads) / (memory read
bandwidth measured now), our engine at budget `all` (--exact's transformers kernels and the native ones, the default), and
stock transformers with its best experts implementation — 3 interleaved repetitions, median.
Also the engine at a budget below `all` with the disk store, against time at `all` + the bytes it
loaded per token / the disk bandwidth measured now (do loads overlap compute?).

    python -m bench.decode_limit [--reps 3] [--prompt-len 128] [--decode 64] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.bandwidth import disk_random_read_bandwidth, disk_read_bandwidth, memory_read_bandwidth
from bench.format_settings import active_bytes_per_token, split_format
from bench.output import RESULTS_DIR, write_report
from bench.synthetic import build_checkpoint
from engine.system.process_settings import apply_process_settings


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


def paired_ratios(runs: list[dict], active_bytes: int) -> list[float]:
    """Each run's tokens/s over the limit at the bandwidth measured around that very run."""
    return [r["decode_tokens_per_s"] * active_bytes / ((r["bandwidth_before"] + r["bandwidth_after"]) / 2)
            for r in runs]


def decode_s_per_token(run: dict) -> float:
    return 1.0 / run["decode_tokens_per_s"]


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.decode_limit")
    parser.add_argument("--geometries", default="qwen3moe-64e,mixtral-8e")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--offload-budget", default="50%", help="the budget < all run with the disk store")
    parser.add_argument("--format", default=None,
                        help="MoEScope's weight format (bench.format_settings: q8_0, q4_k, ...); the limit counts its bytes. "
                             "transformers stays on the checkpoint's own weights, so tokens are not compared")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    common = ["--prompt-len", str(args.prompt_len), "--decode", str(args.decode), "--threads", str(args.threads)]
    rows = []
    for name in args.geometries.split(","):
        path = build_checkpoint(name)
        experts_format, dense_format = split_format(args.format) if args.format else (None, None)
        active, _, expert_bytes = active_bytes_per_token(path, experts_format, dense_format)
        files = sorted(path.glob("*.safetensors"))
        runs: dict[str, list[dict]] = {k: [] for k in ("ours", "fast", "stock", "ours_disk", "fast_disk")}
        bandwidth, disk, disk_random = [], [], []
        ours = ["ours", "--model", str(path), *common, *(["--format", args.format] if args.format else [])]
        for _ in range(args.reps):  # interleaved, so drift in machine load hits every system alike
            bandwidth.append(memory_read_bandwidth(threads=args.threads))
            disk.append(disk_read_bandwidth(files))
            disk_random.append(disk_random_read_bandwidth(files, expert_bytes))
            runs["ours"].append(run_measure(*ours, "--budget", "all", "--store", "ram", "--bandwidth"))
            runs["fast"].append(run_measure(*ours, "--budget", "all", "--store", "ram", "--fast-decode", "--bandwidth"))
            runs["stock"].append(run_measure("stock", "--model", str(path), *common, "--bandwidth"))
            runs["ours_disk"].append(run_measure(*ours, "--budget", args.offload_budget, "--store", "disk"))
            runs["fast_disk"].append(run_measure(*ours, "--budget", args.offload_budget, "--store", "disk",
                                                 "--fast-decode"))
        bw, disk_bw, random_bw = statistics.median(bandwidth), statistics.median(disk), statistics.median(disk_random)
        limit = bw / active
        tps = {k: median_of(v, "decode_tokens_per_s") for k, v in runs.items()}
        reference = runs["stock"][0]["token_ids"]
        row = {
            "geometry": name, "active_bytes_per_token": active, "bandwidth_bytes_per_s": bw,
            "disk_bytes_per_s": disk_bw, "disk_random_bytes_per_s": random_bw, "limit_tokens_per_s": limit,
            **{f"{k}_tokens_per_s": v for k, v in tps.items()},
            **{f"{k}_over_limit": tps[k] / limit for k in ("ours", "fast", "stock")},
            # each run against the bandwidth measured in its own process just before and after it
            **{f"{k}_over_paired_limit": statistics.median(paired_ratios(runs[k], active))
               for k in ("ours", "fast", "stock")},
            **{f"{k}_prefill_tokens_per_s": median_of(runs[k], "prefill_tokens_per_s") for k in ("ours", "fast", "stock")},
            "ours_same_tokens": None if args.format else all(r["token_ids"] == reference
                                                             for r in runs["ours"] + runs["ours_disk"]),
            "fast_same_tokens_prefix": None if args.format else min(same_prefix(r["token_ids"], reference)
                                                                    for r in runs["fast"] + runs["fast_disk"]),
            "format": args.format or "the checkpoint's",
            "offload_budget": args.offload_budget,
            "reps": {**runs, "bandwidth": bandwidth, "disk": disk, "disk_random": disk_random},
        }
        for mode in ("ours", "fast"):  # goal: loads overlap compute instead of adding to it
            loaded = median_of(runs[f"{mode}_disk"], "decode_bytes_per_token")
            bound = 1 / tps[mode] + loaded / disk_bw
            row[f"{mode}_disk_bytes_per_token"] = loaded
            row[f"{mode}_disk_bound_s"] = bound
            row[f"{mode}_disk_over_bound"] = (1 / tps[f"{mode}_disk"]) / bound
            # the same bound at the random-read bandwidth: what on-demand expert loads can get from this disk
            row[f"{mode}_disk_over_random_bound"] = (1 / tps[f"{mode}_disk"]) / (1 / tps[mode] + loaded / random_bw)
        rows.append(row)
        print(f"{name}: limit {limit:.1f} tok/s, ours {tps['ours']:.1f}, ours --fast-decode {tps['fast']:.1f}, "
              f"stock {tps['stock']:.1f}, ours/limit {tps['ours'] / limit:.2f}, fast/limit {tps['fast'] / limit:.2f} "
              f"(paired: {row['ours_over_paired_limit']:.2f} / {row['fast_over_paired_limit']:.2f} / "
              f"stock {row['stock_over_paired_limit']:.2f}); "
              f"{args.offload_budget} disk: time/bound {row['ours_disk_over_bound']:.2f} "
              f"(fast {row['fast_disk_over_bound']:.2f})", flush=True)
    write_results(rows, args)
    return 0


def _same_tokens(row: dict, n: int) -> str:
    if row["ours_same_tokens"] is None:
        return "n/a (other weights)"
    return f"{'all' if row['ours_same_tokens'] else 'no'} / {row['fast_same_tokens_prefix']} of {n}"


def write_results(rows: list[dict], args) -> None:
    lines = [
        f"Decode vs the memory-bandwidth limit — {args.threads} threads, MoEScope's weights "
        f"{args.format or 'bf16'} (transformers: bf16), batch 1, {args.prompt_len}-token prompt, "
        f"{args.decode} decode tokens, median of {args.reps} interleaved runs. Bandwidth: float32 sum over 1 GiB "
        "in 2 MiB pages (pure read, median of 7 passes). `limit` uses the bandwidth measured before each "
        "repetition. The `/limit` columns set each run against the bandwidth measured in its own process just "
        "before and just after it (median of the runs' ratios); in brackets, against `limit`.",
        "",
        "| geometry | active MB/token | read GB/s | limit tok/s | MoEScope --exact tok/s | MoEScope fast tok/s "
        "| transformers tok/s | MoEScope/limit | fast-decode/limit | transformers/limit | same tokens as transformers "
        "(exact / fast-decode) | prefill MoEScope / fast-decode / transformers tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = len(r["reps"]["stock"][0]["token_ids"])
        lines.append(
            f"| {r['geometry']} | {r['active_bytes_per_token'] / 1e6:.0f} | {r['bandwidth_bytes_per_s'] / 1e9:.1f} | "
            f"{r['limit_tokens_per_s']:.1f} | {r['ours_tokens_per_s']:.1f} | {r['fast_tokens_per_s']:.1f} | "
            f"{r['stock_tokens_per_s']:.1f} | {r['ours_over_paired_limit']:.2f} ({r['ours_over_limit']:.2f}) | "
            f"{r['fast_over_paired_limit']:.2f} ({r['fast_over_limit']:.2f}) | "
            f"{r['stock_over_paired_limit']:.2f} ({r['stock_over_limit']:.2f}) | "
            f"{_same_tokens(r, n)} | {r['ours_prefill_tokens_per_s']:.0f} / "
            f"{r['fast_prefill_tokens_per_s']:.0f} / {r['stock_prefill_tokens_per_s']:.0f} |"
        )
    lines += [
        "",
        "Budget < all with the disk store (goal: time per token <= 1.3 x (time at all + loaded bytes / disk "
        "bandwidth), i.e. loads overlap compute; issue 20 takes the random-read bandwidth). Disk bandwidth: "
        "sequential 16 MiB reads, pages dropped; in brackets, reads of one expert's size at random offsets, the "
        "pattern of on-demand loads (the goal's bound):",
        "",
        "| geometry | budget | disk GB/s seq (random) | mode | ms/token at all | MB loaded/token | bound ms | ms/token "
        "| time/bound (at random-read bw) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for mode, label in (("ours", "exact"), ("fast", "fast (default)")):
            lines.append(
                f"| {r['geometry']} | {r['offload_budget']} | {r['disk_bytes_per_s'] / 1e9:.2f} "
                f"({r['disk_random_bytes_per_s'] / 1e9:.2f}) | {label} | "
                f"{1e3 / r[f'{mode}_tokens_per_s']:.1f} | {r[f'{mode}_disk_bytes_per_token'] / 1e6:.0f} | "
                f"{r[f'{mode}_disk_bound_s'] * 1e3:.1f} | {1e3 / r[f'{mode}_disk_tokens_per_s']:.1f} | "
                f"{r[f'{mode}_disk_over_bound']:.2f} ({r[f'{mode}_disk_over_random_bound']:.2f}) |"
            )
    name = f"decode-limit-{args.format}" if args.format else "decode-limit"
    write_report(args.out, name, {"threads": args.threads, "format": args.format, "rows": rows}, lines)


if __name__ == "__main__":
    sys.exit(main())
