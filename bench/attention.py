"""`python -m bench.attention`: one query's attention over a long KV cache, side by side.

For real models' head layouts and a few context lengths: the native kernel's `attend` (what fast
decode runs; the query heads of a kv head together where the build allows), torch's
scaled_dot_product_attention on the same bf16 tensors (what transformers' sdpa attention calls),
and the limit: the cache's bytes over the memory read bandwidth measured in the same round. Each
call reads another layer's cache, cycled through more than the last-level cache holds, as a
decode token reads every layer's cache once. Interleaved rounds, medians.

    python -m bench.attention [--lengths 512,2048,8192] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.native import ready_kernels
from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

# name: (query heads, kv heads, head size)
LAYOUTS = {
    "qwen3moe-64e (bench)": (16, 4, 64),
    "Qwen3-30B-A3B": (32, 4, 128),
    "gpt-oss-20b": (64, 8, 64),
    "Mixtral-8x7B": (32, 8, 128),
}


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.attention")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cycled-mib", type=int, default=768,
                        help="the caches a run cycles through (past the last-level cache: 480 MiB on the VM measured)")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from bench.bandwidth import memory_read_bandwidth

    if (kernels := ready_kernels(args.threads)) is None:
        return 1
    rows = []
    for name, (heads, kv_heads, d) in LAYOUTS.items():
        for length in map(int, args.lengths.split(",")):
            cache_bytes = 2 * kv_heads * length * d * 2
            layers = max(2, (args.cycled_mib << 20) // cache_bytes)
            caches = [(torch.randn(1, kv_heads, length, d).to(torch.bfloat16),
                       torch.randn(1, kv_heads, length, d).to(torch.bfloat16)) for _ in range(layers)]
            q = torch.randn(1, heads, 1, d).to(torch.bfloat16)
            scale = d ** -0.5
            systems = {
                "ours": lambda k, v, q=q, scale=scale: kernels.attend(q, k, v, scale),
                "torch": lambda k, v, q=q, scale=scale: F.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                   enable_gqa=True),
            }
            seconds: dict[str, list[float]] = {s: [] for s in systems}
            bandwidth = []
            for round_ in range(args.rounds):
                bandwidth.append(memory_read_bandwidth(nbytes=256 << 20, repeats=3, threads=args.threads))
                for system in (reversed(list(systems)) if round_ % 2 else list(systems)):
                    call = systems[system]
                    start = time.perf_counter()
                    for k, v in caches:
                        call(k, v)
                    seconds[system].append((time.perf_counter() - start) / layers)
            ours, reference = kernels.attend(q, *caches[0], scale), systems["torch"](*caches[0])
            error = ((ours.float().view(-1) - reference.float().reshape(-1)).abs().max()
                     / reference.float().abs().max()).item()
            bw = statistics.median(bandwidth)
            row = {"layout": name, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "length": length,
                   "cache_bytes": cache_bytes, "bandwidth_bytes_per_s": bw, "error": error,
                   **{f"{s}_s": statistics.median(t) for s, t in seconds.items()}}
            row["limit_s"] = cache_bytes / bw
            rows.append(row)
            print(f"{name} T={length}: ours {row['ours_s'] * 1e6:.0f} us, torch {row['torch_s'] * 1e6:.0f} us, "
                  f"limit {row['limit_s'] * 1e6:.0f} us", flush=True)
            del caches
    lines = [f"One query's attention over a bf16 KV cache, {args.threads} threads, median of {args.rounds} interleaved "
             f"rounds; each call reads another layer's cache (cycled through {args.cycled_mib} MiB). Limit: the cache's bytes over "
             "the memory read bandwidth measured in the same rounds. torch: scaled_dot_product_attention "
             "(enable_gqa), the same inputs. Error: max |ours - torch| / max |torch| (outputs are bf16).",
             "", "| layout (q / kv heads x size) | positions | cache MiB | ours us | torch us | torch / ours | "
             "ours / limit time | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} ({r['heads']} / {r['kv_heads']} x {r['head_dim']}) | {r['length']} | "
                     f"{r['cache_bytes'] / 2**20:.1f} | {r['ours_s'] * 1e6:.0f} | {r['torch_s'] * 1e6:.0f} | "
                     f"{r['torch_s'] / r['ours_s']:.2f} | {r['ours_s'] / r['limit_s']:.2f} | {r['error']:.1e} |")
    write_report(Path(args.out), "attention", {"args": vars(args), "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
