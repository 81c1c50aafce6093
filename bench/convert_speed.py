"""Converting a model to a block format: MoEScope against `llama-quantize`, side by side.

What a user waits for the first time they pick "4-bit experts" (and 4-bit dense weights) in the
window, against what llama.cpp's own tool takes to make the same model's file in the same type
from its BF16 GGUF (`--pure`: every tensor in that type, no K-quant mixture). Each round times:

- llama-quantize, BF16 GGUF -> the type, into a scratch folder;
- a MoEScope load that converts the experts and the dense weights (into an empty cache folder),
  less a load of the same model in its original format in the same round: the conversion is the
  difference.

Rates are bytes of source weights a second (the BF16 GGUF's tensors; the weights MoEScope
converted); the ratio is MoEScope's rate over llama-quantize's, the median of the rounds. Marked
slow: it builds llama.cpp once (bench.llamacpp_build).

    python -m bench.convert_speed --geometry qwen3moe-64e [--formats q4_k,q8_0] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

# MoEScope format -> llama-quantize type whose base type it is (with --pure, every tensor takes it)
LLAMA_PURE_TYPE = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q4_k": "Q4_K_M", "q3_k": "Q3_K_M", "q2_k": "Q2_K"}


def time_llama_quantize(tool: Path, source: Path, fmt: str, threads: int, scratch: Path) -> float:
    import subprocess

    out = scratch / f"{fmt}.gguf"
    start = time.perf_counter()
    proc = subprocess.run([str(tool), "--pure", str(source), str(out), LLAMA_PURE_TYPE[fmt], str(threads)],
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {(proc.stdout + proc.stderr)[-2000:]}")
    out.unlink()
    return seconds


def time_moescope_load(path: str, fmt: str | None, cache: Path) -> tuple[float, int]:
    """Seconds a load took with an empty conversion cache, and the bytes of weights it converted."""
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    os.environ["XDG_CACHE_HOME"] = str(cache)  # where the conversions go (platformdirs' user cache)
    fields = {} if fmt is None else {"expert_format": fmt, "dense_format": fmt}
    start = time.perf_counter()
    runtime = MoERuntime(LoadModel(path=path, budget="all", store="disk", warm=False, **fields))
    seconds = time.perf_counter() - start
    converted = converted_bytes(runtime) if fmt is not None else 0
    runtime.close()
    return seconds, converted


def converted_bytes(runtime) -> int:
    """Bytes the source checkpoint held for the weights now in a block format."""
    from engine.model.dense_quantize import QuantizedLinear

    itemsize = runtime.dtype.itemsize
    experts = runtime.layout.num_layers * runtime.layout.num_experts * sum(
        p.rows_columns[0] * p.rows_columns[1] for p in runtime.layout.params if p.fmt is not None) * itemsize
    dense = sum(m.out_features * m.in_features for m in runtime.model.modules()
                if isinstance(m, QuantizedLinear)) * itemsize
    return experts + dense


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="qwen3moe-64e")
    parser.add_argument("--formats", default="q4_k")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    import torch

    from bench.gguf_files import checkpoint_key, ensure_ggufs
    from bench.llamacpp_build import build_tools
    from bench.synthetic import build_checkpoint

    torch.set_num_threads(args.threads)
    model_dir = build_checkpoint(args.geometry)
    lc = build_tools(log=lambda m: print(m, file=sys.stderr))
    ensure_ggufs(model_dir, types=(), lc=lc)  # converts the BF16 file once
    bf16_gguf = lc.gguf_dir / checkpoint_key(model_dir) / "BF16.gguf"
    gguf_bytes = gguf_tensor_bytes(bf16_gguf)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moescope-convert-speed-") as tmp:
        scratch = Path(tmp)
        for fmt in args.formats.split(","):
            llama_s, ours_s, converted = [], [], 0
            for _ in range(args.rounds):
                llama_s.append(time_llama_quantize(lc.tool("llama-quantize"), bf16_gguf, fmt, args.threads, scratch))
                plain, _ = time_moescope_load(str(model_dir), None, scratch / "cache")
                loaded, converted = time_moescope_load(str(model_dir), fmt, scratch / "cache")
                ours_s.append(max(loaded - plain, 1e-9))
                print(f"{fmt}: llama-quantize {llama_s[-1]:.1f} s, MoEScope conversion {ours_s[-1]:.1f} s",
                      file=sys.stderr)
            ratio = statistics.median((converted / o) / (gguf_bytes / q) for o, q in zip(ours_s, llama_s, strict=True))
            rows.append({"format": fmt, "llama_type": LLAMA_PURE_TYPE[fmt] + " --pure", "llama_seconds": llama_s,
                         "llama_bytes": gguf_bytes, "ours_seconds": ours_s, "ours_bytes": converted,
                         "ours_over_llama": ratio})
    lines = [f"Conversion speed: {args.geometry}, {args.threads} threads, {args.rounds} rounds. MoEScope: experts and "
             "dense weights converted at load (a load in the original format subtracted); llama-quantize: the BF16 "
             "GGUF to the type with --pure. Ratio: MoEScope's bytes a second over llama-quantize's, median of rounds.",
             "", "| format | llama-quantize | GB/s | MoEScope | GB/s | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        q, o = statistics.median(r["llama_seconds"]), statistics.median(r["ours_seconds"])
        lines.append(f"| {r['format']} | {q:.1f} s | {r['llama_bytes'] / q / 1e9:.3f} | {o:.1f} s | "
                     f"{r['ours_bytes'] / o / 1e9:.3f} | {r['ours_over_llama']:.2f} |")
    kind = f"convert-speed-{args.geometry}" + (f"-{args.tag}" if args.tag else "")
    write_report(args.out, kind, {"geometry": args.geometry, "threads": args.threads, "rows": rows}, lines)
    return 0


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors llama-quantize reads (every tensor of the file)."""
    from bench.gguf_files import _gguf

    reader = _gguf().GGUFReader(path)
    return sum(int(t.n_bytes) for t in reader.tensors)


if __name__ == "__main__":
    sys.exit(main())
