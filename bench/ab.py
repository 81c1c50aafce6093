"""Before and after: one benchmark run alternately from two checkouts, side by side in one table.

On the 2-core VM the memory bandwidth swings by up to 2x within minutes, so a change is judged by
runs interleaved in time, never by runs of different hours. Each round runs the benchmark module
once per side (the order flips every round, so a drift in the host's speed falls on both sides
alike); each side is its own checkout with its own Python (a worktree of the older commit and its
venv), and may get its own environment (e.g. which kernel variant it runs). Per row of the
benchmark's results (`payload["rows"]`, keyed by `--key`) and per metric: the median of each side
and the median of the per-round ratios after / before.

    python -m bench.ab --before ../old --before-python ../old/.venv/bin/python --rounds 3 \\
        --metrics fast_share,fast_tokens_per_s -- decode_pair --geometries qwen3moe-64e --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

HERE = Path(__file__).resolve().parents[1]


def _env(pairs: list[str]) -> dict[str, str]:
    extra = dict(pair.split("=", 1) for pair in pairs)
    return {**os.environ, **extra}


def run_side(root: Path, python: str, env: dict[str, str], module: str, args: list[str], out: Path | None,
             key: str) -> list[dict]:
    """One run of bench.`module` in checkout `root`; its rows: those of the results file it wrote
    under `out`, or (out None: a module that prints one JSON object, as bench.measure) that object."""
    env = {**env, "PYTHONPATH": str(root)}
    extra = [] if out is None else ["--out", str(out)]
    done = subprocess.run([python, "-m", f"bench.{module}", *args, *extra], cwd=root, env=env,
                          check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench.{module} failed in {root}:\n{done.stderr[-3000:]}")
    if out is None:
        return [{key: "run", **json.loads(done.stdout.strip().splitlines()[-1])}]
    return json.loads(next(out.glob("*.json")).read_text())["rows"]


def value(row: dict, metric: str) -> float:
    """A row's `metric`: a field, or `a/b` for one field over another (decode_tokens_per_s/bandwidth_before:
    decode speed per unit of the memory bandwidth measured with it)."""
    top, _, bottom = metric.partition("/")
    return row[top] / row[bottom] if bottom else row[top]


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    parser.add_argument("--before", type=Path, required=True, help="the older checkout")
    parser.add_argument("--before-python", default=sys.executable)
    parser.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--after", type=Path, default=HERE, help="the newer checkout (this one)")
    parser.add_argument("--after-python", default=sys.executable)
    parser.add_argument("--after-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--key", default="geometry", help="the field naming a row")
    parser.add_argument("--metrics", required=True, help="comma-separated row fields to compare (a/b: a over b)")
    parser.add_argument("--label", default="", help="named in the results file (ab-LABEL-...)")
    parser.add_argument("--printed", action="store_true",
                        help="the module prints one JSON object (bench.measure) instead of writing a results file")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- MODULE ARGS... (a bench module and its options)")
    args = parser.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --, e.g. -- decode_pair --reps 1")
    module, bench_args = bench[0], bench[1:]
    metrics = args.metrics.split(",")
    sides = {"before": (args.before.resolve(), args.before_python, _env(args.before_env)),
             "after": (args.after.resolve(), args.after_python, _env(args.after_env))}
    results: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="moescope-ab-") as scratch:
        for round_ in range(args.rounds):
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for side in order:
                root, python, env = sides[side]
                out = None if args.printed else Path(scratch) / f"{side}-{round_}"
                results[side].append(run_side(root, python, env, module, bench_args, out, args.key))
                print(f"round {round_ + 1}, {side}: " + "; ".join(
                    f"{r[args.key]} " + ", ".join(f"{m} {value(r, m):.3g}" for m in metrics) for r in results[side][-1]),
                    flush=True)
    keys = [r[args.key] for r in results["after"][0]]
    rows = []
    for key in keys:
        row: dict = {args.key: key}
        for metric in metrics:
            before = [value(next(r for r in rs if r[args.key] == key), metric) for rs in results["before"]]
            after = [value(next(r for r in rs if r[args.key] == key), metric) for rs in results["after"]]
            row[metric] = {"before": before, "after": after,
                           "ratio": statistics.median(a / b for a, b in zip(after, before, strict=True))}
        rows.append(row)
    env_note = "; ".join(f"{side}: {' '.join(getattr(args, f'{side}_env'))}" for side in sides
                         if getattr(args, f"{side}_env"))
    lines = [
        f"Before / after, `python -m bench.{module} {' '.join(bench_args)}` run alternately from two checkouts "
        f"({args.rounds} rounds, the order flipped each round{'; ' + env_note if env_note else ''}). Before: "
        f"{sides['before'][0].name}; after: {sides['after'][0].name}. Medians; ratio = median of the rounds' "
        "after / before.",
        "",
        f"| {args.key} | metric | before | after | after / before |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        for metric in metrics:
            m = row[metric]
            lines.append(f"| {row[args.key]} | {metric} | {statistics.median(m['before']):.3g} | "
                         f"{statistics.median(m['after']):.3g} | {m['ratio']:.3f} |")
    write_report(args.out, f"ab-{args.label}" if args.label else "ab",
                 {"module": module, "args": bench_args, "rounds": args.rounds, "rows": rows,
                  "before": str(sides["before"][0]), "after": str(sides["after"][0]),
                  "before_env": args.before_env, "after_env": args.after_env}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
