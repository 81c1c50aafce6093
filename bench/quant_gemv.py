"""`python -m bench.quant_gemv`: one quantized matrix times one row, per block format, side by side.

For each format: the native kernels' integer dots (the default, engine/decode/native/quant_int.h),
for the K-quants also with the opt-in lossy 8-bit inputs (--int8-inputs), their reference-exact
float loops (quant.h: every weight dequantized to its bf16 value first), and
the same matrix in bf16, interleaved and repeated, medians; in weights/s and against the memory
read bandwidth measured in the same run (bytes of the format / bandwidth: the limit of a
one-row product that streams the matrix once). Also the error of each against the float32 product
on the float32 dequantized weights, relative to its largest value.

    python -m bench.quant_gemv [--rows 4096 --cols 4096] [--threads 2] [--reps 7] [--formats q4_k,q8_0,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.native import ready_kernels
from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

DEFAULT_FORMATS = "q8_0,q6_k,q5_0,q4_k,q4_0,q3_k,q2_k"


def timed(call, reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.quant_gemv")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7, help="timed calls per measurement (median)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the systems (median)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)

    import torch

    from bench.bandwidth import memory_read_bandwidth
    from engine.decode.native import kernels as native
    from engine.decode.native.testing import forced_paths
    from engine.formats.blocks import FORMATS, K_QUANTS
    from engine.formats.dequantize import dequantize
    from engine.formats.quantize import quantize

    if (kernels := ready_kernels(args.threads)) is None:
        return 1
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(args.rows, args.cols, generator=generator) * 0.02
    x = torch.randn(1, args.cols, generator=generator).to(torch.bfloat16)
    plain = native.weight(kernels, w.to(torch.bfloat16))
    rows, weights = [], args.rows * args.cols
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        packed = torch.from_numpy(quantize(w.numpy(), fmt))
        matrix = native.weight(kernels, packed, fmt, args.cols)
        truth = x.float() @ dequantize(packed, fmt, args.cols).t()
        order = ["integer", *(["int8"] if name in K_QUANTS else []), "float", "bf16"]
        seconds: dict[str, list[float]] = {system: [] for system in order}
        bandwidth = []
        for round_ in range(args.rounds):
            bandwidth.append(memory_read_bandwidth(nbytes=256 << 20, repeats=3, threads=args.threads))
            for system in reversed(order) if round_ % 2 else order:
                target = plain if system == "bf16" else matrix
                with forced_paths(kernels, integer_dots=system != "float", int8_inputs=system == "int8"):
                    seconds[system].append(timed(lambda target=target: kernels.gemv(target, x), args.reps))
        errors = {}
        for system in [s for s in order if s != "bf16"]:
            with forced_paths(kernels, integer_dots=system != "float", int8_inputs=system == "int8"):
                errors[system] = ((kernels.gemv(matrix, x).float() - truth).abs().max() / truth.abs().max()).item()
        bw = statistics.median(bandwidth)
        row = {"format": name, "bits": fmt.bits, "bandwidth_bytes_per_s": bw, "errors": errors,
               **{f"{s}_weights_per_s": weights / statistics.median(t) for s, t in seconds.items()},
               **{f"{s}_over_limit": (packed.numel() if s != "bf16" else 2 * weights) / statistics.median(t) / bw
                  for s, t in seconds.items()}}
        rows.append(row)
        eight = f", 8-bit inputs {row['int8_weights_per_s'] / 1e9:.1f}" if "int8" in seconds else ""
        print(f"{name}: integer {row['integer_weights_per_s'] / 1e9:.1f}{eight}, float loops "
              f"{row['float_weights_per_s'] / 1e9:.1f}, bf16 {row['bf16_weights_per_s'] / 1e9:.1f} Gweights/s", flush=True)
    lines = [f"Quantized one-row products, {args.rows}x{args.cols}, {args.threads} threads, median of {args.rounds} "
             f"interleaved rounds of {args.reps} calls. G/s = 10^9 weights/s; `limit` = the format's bytes over the "
             "memory read bandwidth measured in the same round (1.00 = streaming the matrix at that speed); error = "
             "max |ours - float32 product on the float32 dequantized weights| / max |that product| (outputs are bf16).",
             "8-bit inputs: the opt-in lossy --int8-inputs (K-quants only; its error includes the input's rounding).",
             "", "| format | bits/weight | integer dots G/s (limit) | 8-bit inputs G/s (limit) | float loops G/s (limit) "
             "| integer / float loops | bf16 matrix G/s (limit) | error integer / 8-bit inputs / float loops |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eight = "int8_weights_per_s" in r
        lines.append(f"| {r['format']} | {r['bits']:.2f} | {r['integer_weights_per_s'] / 1e9:.1f} "
                     f"({r['integer_over_limit']:.2f}) | "
                     + (f"{r['int8_weights_per_s'] / 1e9:.1f} ({r['int8_over_limit']:.2f})" if eight else "-")
                     + f" | {r['float_weights_per_s'] / 1e9:.1f} ({r['float_over_limit']:.2f}) "
                     f"| {r['integer_weights_per_s'] / r['float_weights_per_s']:.2f}x | "
                     f"{r['bf16_weights_per_s'] / 1e9:.1f} ({r['bf16_over_limit']:.2f}) | "
                     f"{r['errors']['integer']:.1e} / " + (f"{r['errors']['int8']:.1e}" if eight else "-")
                     + f" / {r['errors']['float']:.1e} |")
    from pathlib import Path

    write_report(Path(args.out), "quant-gemv", {"args": vars(args), "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
