"""MoEScope against llama.cpp, side by side in one run: decode and prefill tokens/s per weight
format, both set against the memory-bandwidth limit of the bytes a token reads in that format.

llama.cpp is built from the pinned sdist (bench.llamacpp_build), each checkpoint converted and
quantized with its own tools (bench.gguf_files). Each MoEScope format of bench.format_settings is set
against the llama.cpp type of the same bits (bf16 - BF16, q8_0 - Q8_0, q4_k - Q4_K_M); formats
MoEScope has not got yet are still measured on the llama.cpp side and marked n/a on ours.

Per repetition and format: the memory read bandwidth, then llama.cpp (`llama-bench`: prefill
`-p P`, and decode `-n N` after a P-token context `-d P`, each its own process, `-r 1` after its
warm-up run), MoEScope exact and MoEScope --fast-decode (`bench.measure`, one process each:
budget all, RAM store, P-token prompt, N decode tokens), and MoEScope --fast-decode opening
llama.cpp's own GGUF file directly (`gguf`: the same bytes llama-bench reads, experts kept in the
file's quant types); the order flips every repetition.
Ratios are taken per repetition, then the median.

    python -m bench.llamacpp [--geometries qwen3moe-64e,mixtral-8e] [--formats bf16,q8_0,q4_k] [--reps 3]
                             [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench import format_settings as formats
from bench.decode_limit import run_measure
from bench.gguf_files import TokenBytes, ensure_ggufs, gguf_token_bytes
from bench.llamacpp_build import (
    ISA_VARIANT,
    ISAS,
    VERSION,
    LlamaCpp,
    LlamaCppUnavailable,
    build_target,
    build_tools,
    hold_to_isa,
)
from bench.output import RESULTS_DIR, write_report
from bench.synthetic import build_checkpoint
from engine.decode.native.library import VARIANT_ENV
from engine.system.process_settings import apply_process_settings

# llama.cpp, MoEScope exact, MoEScope --fast-decode, MoEScope --fast-decode on the GGUF file, and the last
# two with the opt-in lossy --int8-inputs: the run order
SYSTEMS = ("llama", "exact", "fast", "gguf", "fast-int8", "gguf-int8")
INT8_SYSTEMS = ("fast-int8", "gguf-int8")
COLUMNS = ("exact", "fast", "llama")  # the main table's order; `gguf` has a table of its own


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench's `-o json` output: tokens/s of its prompt test (prefill) and its generation
    test (decode), the median of each test's samples."""
    out: dict[str, float] = {}
    for test in json.loads(text):
        key = "decode_tokens_per_s" if test["n_gen"] > 0 else "prefill_tokens_per_s"
        if key in out:
            raise ValueError("llama-bench ran more than one test of a kind: --llama-bench-args must not add any")
        out[key] = statistics.median(test["samples_ts"])
    return out


def run_llama_bench(lc: LlamaCpp, gguf: Path, args) -> dict[str, float]:
    common = [str(lc.tool("llama-bench")), "-m", str(gguf), "-t", str(args.threads), "-r", "1", "-o", "json",
              *shlex.split(args.llama_bench_args)]
    result: dict[str, float] = {}
    # decode after a prompt-long context, as ours decodes after the prompt
    for test in (["-p", str(args.prompt_len), "-n", "0"], ["-p", "0", "-n", str(args.decode), "-d", str(args.prompt_len)]):
        proc = subprocess.run([*common, *test], capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed on {gguf}: {proc.stderr.strip()[-2000:]}")
        result.update(parse_llama_bench(proc.stdout))
    return result


def run_moescope(path: Path, fmt: str, fast: bool, args, int8_inputs: bool = False) -> dict[str, float]:
    run = run_measure("ours", "--model", str(path), "--budget", "all", "--store", "ram", "--format", fmt,
                      "--threads", str(args.threads), "--prompt-len", str(args.prompt_len), "--decode", str(args.decode),
                      *(["--fast-decode"] if fast else []), *(["--int8-inputs"] if int8_inputs else []))
    return {k: run[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}


def run_moescope_gguf(gguf: Path, args, int8_inputs: bool = False) -> dict[str, float]:
    """MoEScope opening the GGUF file llama.cpp runs (bf16 compute, the file's own weight types)."""
    run = run_measure("ours", "--model", str(gguf), "--budget", "all", "--store", "ram", "--threads",
                      str(args.threads), "--prompt-len", str(args.prompt_len), "--decode", str(args.decode),
                      "--fast-decode", *(["--int8-inputs"] if int8_inputs else []))
    return {k: run[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}


def availability(path: Path, fmt: str) -> tuple[int | None, str | None]:
    """(bytes a decode token reads in MoEScope's `fmt`, None) or (None, why MoEScope cannot run it)."""
    try:
        formats.load_settings(fmt)
        return formats.bytes_per_token(path, fmt), None
    except formats.FormatNotAvailable as e:
        return None, str(e)


def measure_geometry(lc: LlamaCpp, name: str, path: Path, fmts: list[str], args) -> list[dict]:
    from bench.bandwidth import memory_read_bandwidth

    ggufs = ensure_ggufs(path, tuple(formats.LLAMA_TYPE[f] for f in fmts), lc=lc)
    llama_bytes: dict[str, TokenBytes] = {f: gguf_token_bytes(ggufs[formats.LLAMA_TYPE[f]]) for f in fmts}
    ours = {f: availability(path, f) for f in fmts}
    reps: dict[str, list[dict]] = {f: [] for f in fmts}
    for rep in range(args.reps):  # interleaved; the order flips so drift hits no system more than another
        flip = rep % 2 == 1
        for fmt in reversed(fmts) if flip else fmts:
            runs: dict = {"bandwidth": memory_read_bandwidth(threads=args.threads)}
            systems = [s for s in SYSTEMS if s in args.systems]
            for system in reversed(systems) if flip else systems:
                if system == "llama":
                    runs[system] = run_llama_bench(lc, ggufs[formats.LLAMA_TYPE[fmt]], args)
                elif system in ("gguf", "gguf-int8"):
                    runs[system] = run_moescope_gguf(ggufs[formats.LLAMA_TYPE[fmt]], args, system in INT8_SYSTEMS)
                elif ours[fmt][0] is not None:
                    runs[system] = run_moescope(path, fmt, system != "exact", args, system in INT8_SYSTEMS)
            reps[fmt].append(runs)
            print(f"{name} {fmt} rep {rep + 1}: " + ", ".join(
                f"{s} {runs[s]['decode_tokens_per_s']:.1f} / {runs[s]['prefill_tokens_per_s']:.0f}"
                for s in systems if s in runs) + " tok/s (decode / prefill)", flush=True)
    return [summarise(name, fmt, reps[fmt], ours[fmt], llama_bytes[fmt]) for fmt in fmts]


def summarise(name: str, fmt: str, reps: list[dict], ours: tuple[int | None, str | None], llama: TokenBytes) -> dict:
    """Medians over the repetitions of tokens/s, of MoEScope / llama.cpp, and of each run over the
    limit at the bandwidth measured just before its format's runs."""
    ours_bytes, why = ours
    # gguf: the file's bytes (a tensor converted at load aside)
    token_bytes = {"llama": llama.bytes_per_token, "exact": ours_bytes, "fast": ours_bytes, "fast-int8": ours_bytes,
                   "gguf": llama.bytes_per_token, "gguf-int8": llama.bytes_per_token}
    row: dict = {"geometry": name, "format": fmt, "llama_type": formats.LLAMA_TYPE[fmt], "moescope_unavailable": why,
                 "moescope_bytes_per_token": ours_bytes, "llama_bytes_per_token": llama.bytes_per_token,
                 "llama_bytes_by_type": llama.bytes_by_type, "llama_file_bytes": llama.file_bytes,
                 "bandwidth_bytes_per_s": statistics.median(r["bandwidth"] for r in reps), "reps": reps}
    for system in [s for s in SYSTEMS if s in reps[0] and (why is None or s in ("llama", "gguf", "gguf-int8"))]:
        for phase in ("decode", "prefill"):
            row[f"{system}_{phase}_tokens_per_s"] = statistics.median(r[system][f"{phase}_tokens_per_s"] for r in reps)
        row[f"{system}_decode_over_limit"] = statistics.median(
            r[system]["decode_tokens_per_s"] * token_bytes[system] / r["bandwidth"] for r in reps)
        if system != "llama":
            for phase in ("decode", "prefill"):
                key = f"{phase}_tokens_per_s"
                row[f"{system}_{phase}_over_llama"] = statistics.median(r[system][key] / r["llama"][key] for r in reps)
    return row


def table(rows: list[dict], args) -> list[str]:
    def trio(r: dict, key: str, fmt: str) -> str:
        return " / ".join(fmt.format(r[f"{s}_{key}"]) if f"{s}_{key}" in r else "n/a" for s in COLUMNS)

    def pair(r: dict, key: str) -> str:
        return " / ".join(f"{r[f'{s}_{key}']:.2f}" if f"{s}_{key}" in r else "n/a" for s in ("exact", "fast"))

    lines = [
        f"MoEScope against llama.cpp (llama-cpp-python {VERSION}'s vendored tree, built here: CPU, "
        f"{build_target(args.isa)}, OpenMP) — "
        f"{args.threads} threads, batch 1, {args.prompt_len}-token prompt, {args.decode} decode tokens, median of "
        f"{args.reps} interleaved repetitions. MoEScope: budget all, RAM store, exact and --fast-decode"
        f"{'' if args.isa == 'native' else f', its {ISA_VARIANT[args.isa]} kernel variant ({VARIANT_ENV}={ISA_VARIANT[args.isa]})'}. llama.cpp: "
        f"llama-bench pp{args.prompt_len}, and tg{args.decode} after a {args.prompt_len}-token context (-d), -r 1 each "
        f"after its warm-up{'; ' + args.llama_bench_args if args.llama_bench_args else ''}. Ratios: MoEScope / "
        "llama.cpp per repetition, median. Limit: the memory read bandwidth (float32 sum over 1 GiB in 2 MiB pages, "
        "measured before each format's runs) / the bytes a decode token reads in that format (llama.cpp: from the "
        "GGUF's tensors; the token embeddings left out, top-k of the experts).",
        "",
        "| geometry | format (llama.cpp type) | MB a token: MoEScope / llama.cpp | read GB/s "
        "| decode tok/s: exact / fast / llama.cpp | decode ÷ llama.cpp: exact / fast "
        "| decode / limit: exact / fast / llama.cpp | prefill tok/s: exact / fast / llama.cpp "
        "| prefill ÷ llama.cpp: exact / fast |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours_mb = f"{r['moescope_bytes_per_token'] / 1e6:.0f}" if r["moescope_bytes_per_token"] else "n/a"
        lines.append(
            f"| {r['geometry']} | {r['format']} ({r['llama_type']}) | {ours_mb} / {r['llama_bytes_per_token'] / 1e6:.0f} "
            f"| {r['bandwidth_bytes_per_s'] / 1e9:.1f} | {trio(r, 'decode_tokens_per_s', '{:.1f}')} "
            f"| {pair(r, 'decode_over_llama')} | {trio(r, 'decode_over_limit', '{:.2f}')} "
            f"| {trio(r, 'prefill_tokens_per_s', '{:.0f}')} | {pair(r, 'prefill_over_llama')} |")
    missing = sorted({f"{r['format']}: {r['moescope_unavailable']}" for r in rows if r["moescope_unavailable"]})
    if missing:
        lines += ["", "n/a: " + "; ".join(missing) + "."]
    gguf_rows = [r for r in rows if "gguf_decode_tokens_per_s" in r]
    if gguf_rows:
        lines += ["", "MoEScope --fast-decode opening llama.cpp's GGUF file directly (the same file llama-bench runs):",
                  "", "| geometry | GGUF type | decode tok/s: MoEScope / llama.cpp | decode ÷ llama.cpp "
                  "| prefill tok/s: MoEScope / llama.cpp | prefill ÷ llama.cpp |", "|---|---|---|---|---|---|"]
        seen = set()
        for r in gguf_rows:
            if (r["geometry"], r["llama_type"]) in seen:
                continue  # several formats compare against the same file
            seen.add((r["geometry"], r["llama_type"]))
            lines.append(
                f"| {r['geometry']} | {r['llama_type']} | {r['gguf_decode_tokens_per_s']:.1f} / "
                f"{r['llama_decode_tokens_per_s']:.1f} | {r['gguf_decode_over_llama']:.2f} "
                f"| {r['gguf_prefill_tokens_per_s']:.0f} / {r['llama_prefill_tokens_per_s']:.0f} "
                f"| {r['gguf_prefill_over_llama']:.2f} |")
    int8_rows = [r for r in rows if any(f"{s}_prefill_tokens_per_s" in r for s in INT8_SYSTEMS)]
    if int8_rows:
        def prefill(r: dict, s: str, key: str, fmt: str) -> str:
            return fmt.format(r[f"{s}_{key}"]) if f"{s}_{key}" in r else "n/a"

        lines += ["", "Opt-in, lossy `--int8-inputs` (K-quant experts and dense layers take their inputs rounded to 8 bits, "
                  "prompts and decode, as llama.cpp's own CPU kernels do), MoEScope's Q4_K format and llama.cpp's GGUF "
                  "file opened directly:",
                  "", "| geometry | format (llama.cpp type) | prefill tok/s: int8 / GGUF int8 / llama.cpp "
                  "| prefill ÷ llama.cpp: int8 / GGUF int8 | decode ÷ llama.cpp: int8 / GGUF int8 |",
                  "|---|---|---|---|---|"]
        for r in int8_rows:
            lines.append(
                f"| {r['geometry']} | {r['format']} ({r['llama_type']}) "
                f"| {' / '.join(prefill(r, s, 'prefill_tokens_per_s', '{:.0f}') for s in (*INT8_SYSTEMS, 'llama'))} "
                f"| {' / '.join(prefill(r, s, 'prefill_over_llama', '{:.2f}') for s in INT8_SYSTEMS)} "
                f"| {' / '.join(prefill(r, s, 'decode_over_llama', '{:.2f}') for s in INT8_SYSTEMS)} |")
    return lines


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp")
    parser.add_argument("--geometries", default="qwen3moe-64e,mixtral-8e", help="bench.synthetic names or folders")
    parser.add_argument("--formats", default="bf16,q8_0,q4_k,q4_k-dq8_0",
                        help=f"MoEScope formats (bench.format_settings: {', '.join(formats.LLAMA_TYPE)})")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="which of llama, exact, fast, gguf, fast-int8, gguf-int8 to run (exact decodes far slower: "
                             "leave it out for a quick run; gguf: MoEScope on llama.cpp's GGUF file; *-int8: with the "
                             "opt-in lossy --int8-inputs)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    # weights read into memory at load, as our RAM store holds them: with llama.cpp's default mmap the
    # timed tokens would fault in the pages of experts its one-token warm-up did not touch
    parser.add_argument("--llama-bench-args", default="-lm none",
                        help="llama-bench options beyond threads, tests and output (default: %(default)s)")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="avx2: llama.cpp built for AVX2 and FMA only, against MoEScope's avx2 kernel flavour, "
                             "on a CPU that has more: what an AVX2-only laptop of the same core would get")
    parser.add_argument("--prepare-only", action="store_true", help="build, convert and quantize; measure nothing")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--label", default="", help="named in the results file (llamacpp-LABEL-...), so runs of "
                        "other geometries or formats keep today's main table")
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    fmts = args.formats.split(",")
    unknown = [f for f in fmts if f not in formats.LLAMA_TYPE]
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)}: known {', '.join(formats.LLAMA_TYPE)}")
    hold_to_isa(parser, args.isa)  # every bench.measure process below runs its kernel variant
    try:
        lc = build_tools(isa=args.isa)
        paths = {Path(g).name if Path(g).is_dir() else g: Path(g) if Path(g).is_dir() else build_checkpoint(g)
                 for g in args.geometries.split(",")}  # a geometry of bench.synthetic or a folder
        for path in paths.values():  # every file first, so no conversion runs between timed runs
            ensure_ggufs(path, tuple(formats.LLAMA_TYPE[f] for f in fmts), lc=lc)
    except LlamaCppUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prepare_only:
        return 0
    rows = [row for name, path in paths.items() for row in measure_geometry(lc, name, path, fmts, args)]
    write_report(args.out, f"llamacpp-{args.label}" if args.label else "llamacpp", {"llamacpp_version": VERSION, "isa": args.isa, "threads": args.threads, "reps": args.reps,
                                        "prompt_len": args.prompt_len, "decode": args.decode,
                                        "llama_bench_args": args.llama_bench_args, "rows": rows}, table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
