"""Quantizing speed per block format: the numpy reference (engine/formats/quantize.py) against the
native quantizers (src/formats/quantize.h), side by side in one process.

Each round quantizes one float32 matrix (default [1536, 2048], an expert's projection) once with
each, in an order that alternates every round, so that a busy moment of the host falls on both;
a format's figures are the medians of its rounds' rates (M values a second) and of the per-round
ratios. Both use every core torch uses. Checks on the way that the two wrote the same bytes.

    python -m bench.quantize_speed [--formats q4_k,q6_k] [--rounds 5] [--shape 1536x2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.output import RESULTS_DIR, write_report
from engine.decode.native import kernels as native
from engine.decode.native.library import QUANTIZED_NATIVELY
from engine.formats.blocks import FORMATS
from engine.formats.quantize import quantize
from engine.system.process_settings import apply_process_settings

DEFAULT_FORMATS = "q8_0,q4_0,q5_0,q6_k,q4_k,q3_k,q2_k"


def _seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(name: str, x: np.ndarray, rounds: int) -> dict:
    """Per-round rates of both quantizers on `x` in format `name`, and their medians."""
    kernels = native.load()
    fmt, tensor = FORMATS[name], torch.from_numpy(x)
    if not np.array_equal(np.asarray(quantize(x, fmt)), kernels.quantize(tensor, fmt).numpy()):
        raise SystemExit(f"{name}: the native quantizer's bytes differ from the reference's")
    numpy_rates, native_rates = [], []
    for r in range(rounds):
        runs = [("numpy", lambda: quantize(x, fmt)), ("native", lambda: kernels.quantize(tensor, fmt))]
        for kind, run in runs if r % 2 == 0 else runs[::-1]:
            (numpy_rates if kind == "numpy" else native_rates).append(x.size / _seconds(run) / 1e6)
    ratios = [n / p for n, p in zip(native_rates, numpy_rates, strict=True)]
    return {"format": name, "numpy_mvalues_s": statistics.median(numpy_rates),
            "native_mvalues_s": statistics.median(native_rates), "ratio": statistics.median(ratios),
            "numpy_rounds": numpy_rates, "native_rounds": native_rates}


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="1536x2048", help="rows x columns of the matrix")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if native.load() is None:
        print(native.status(), file=sys.stderr)
        return 1
    rows, cols = (int(v) for v in args.shape.split("x"))
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    names = [n for n in args.formats.split(",") if n in QUANTIZED_NATIVELY]
    results = [measure(name, x, args.rounds) for name in names]
    lines = [f"Quantizing a [{rows}, {cols}] float32 matrix, {torch.get_num_threads()} threads, "
             f"{native.summary()}; medians of {args.rounds} interleaved rounds",
             "", "| format | numpy M values/s | native M values/s | native / numpy |", "|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['numpy_mvalues_s']:.1f} | {r['native_mvalues_s']:.1f} | {r['ratio']:.1f}x |"
              for r in results]
    write_report(args.out, "quantize-speed", {"shape": [rows, cols], "threads": torch.get_num_threads(),
                                              "variant": native.summary(), "results": results}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
