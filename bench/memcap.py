"""A large model under a memory cap: MoEScope's first load (converting to Q4_K) and its decode,
beside llama.cpp decoding the same shape's Q4_K_M GGUF from mmap, each under the same cgroup cap.

The cap is a cgroup v1 memory group (bench.cgroup_cap), which counts the page cache a process's
reads and writes fill as well as its resident memory, as a machine with that much RAM would hold
it to. Where this process cannot make one (no v1 memory controller, not root) the bench skips with
one line saying why. Each step runs in its own process in its own group, a decode `--timeout`
seconds at most:

- convert (at most `--convert-timeout` seconds): a MoEScope load with 4-bit experts and dense
  weights (bench.format_settings `q4_k`) into an empty conversion cache, at the budget below: the
  conversion a user waits for the first time;
- decode: `bench.measure ours`, the same format (the conversion cached), `--store disk`, the
  budget the fit verdict (engine.hub.fit) proposes for a machine with the cap as its RAM;
- llama.cpp: `llama-bench -lm mmap` on the shape's Q4_K_M GGUF, with its default repacking into
  anonymous memory and with `--repack 0` (every weight read from the mapping), `-n N` after a
  P-token context (`-d P`), `-r 1` after its warm-up run. The GGUF is made once, outside the cap,
  by llama.cpp's own converter and llama-quantize (bench.gguf_files).

Peaks: the process's own (ru_maxrss, which counts the file pages it has mapped) and the group's
(memory.max_usage_in_bytes: resident memory and page cache). Slow: not run in CI.

    python -m bench.memcap [--shape qwen3moe-9g] [--cap-gib 2] [--decode 16] [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from bench.cgroup_cap import CappedRun, run_capped, unavailable
from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

GiB = 2**30
FORMAT = "q4_k"  # bench.format_settings: 4-bit experts and dense weights, set against llama.cpp's Q4_K_M
LLAMA_TYPE = "Q4_K_M"


def proposed_budget(model_dir: Path, cap: int) -> tuple[str | None, str]:
    """(--budget, the verdict's headline) the fit verdict gives the model in FORMAT on a machine whose
    RAM is `cap`; no budget where the verdict says it does not run."""
    from engine.hub.estimate import estimate_from_config
    from engine.hub.fit import format_verdicts
    from engine.hub.machine import MachineInfo

    est = estimate_from_config(json.loads((model_dir / "config.json").read_text()))
    machine = MachineInfo(ram_total=cap, ram_available=cap, disk_free=shutil.disk_usage(model_dir).free)
    verdict = next(v.verdict for v in format_verdicts(est, machine) if v.format == FORMAT)
    return (verdict.budget_arg if verdict.runs else None), verdict.headline


def convert_in_this_process(model: str, budget: str) -> dict:
    """The child of the convert step: one load that converts, then what it measured of itself."""
    import time

    from bench.format_settings import load_settings
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel
    from engine.system.memory import peak_rss_bytes

    start = time.perf_counter()
    runtime = MoERuntime(LoadModel(path=model, budget=budget, store="disk", warm=False, **load_settings(FORMAT)))
    seconds = time.perf_counter() - start
    converted = runtime.layout.expert_bytes_on_disk
    runtime.close()
    return {"load_seconds": seconds, "peak_rss_bytes": peak_rss_bytes(), "converted_expert_bytes": converted}


def llama_gguf(model_dir: Path) -> Path:
    """The shape's Q4_K_M GGUF, made once by llama.cpp's tools (its BF16 step removed afterwards:
    it is as large as the checkpoint)."""
    from bench.gguf_files import checkpoint_key, convert, quantize
    from bench.llamacpp_build import build_tools

    lc = build_tools(log=lambda m: print(m, file=sys.stderr))
    folder = lc.gguf_dir / checkpoint_key(model_dir)
    target = folder / f"{LLAMA_TYPE}.gguf"
    if not target.exists():
        bf16 = folder / "BF16.gguf"
        if not bf16.exists():
            convert(lc, model_dir, bf16, "bf16")
        quantize(lc, bf16, target, LLAMA_TYPE)
        bf16.unlink()
    return target


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def _summary(run: CappedRun) -> dict:
    out = {"seconds": run.seconds, "returncode": run.returncode, "peak_rss_bytes": run.peak_rss_bytes,
           "group_peak_bytes": run.group_peak_bytes, "limit_hits": run.limit_hits, "oom_killed": run.oom_killed}
    if run.returncode is None:
        out["error"] = "stopped at the timeout"
    elif run.returncode < 0:
        out["error"] = "OOM-killed" if run.oom_killed else f"killed by signal {-run.returncode}"
    elif run.returncode:
        out["error"] = run.stderr.strip()[-600:] or f"exit status {run.returncode}"
    return out


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def run_ours(model_dir: Path, budget: str, cap: int, args, env: dict) -> dict[str, dict]:
    """The convert step, then the decode step, under the cap, with the conversion cache in `env`."""
    shutil.rmtree(Path(env["XDG_CACHE_HOME"]) / "moescope" / "quantized", ignore_errors=True)
    convert = run_capped(_python("bench.memcap", "convert-child", str(model_dir), budget), cap,
                         timeout=args.convert_timeout, env=env)
    rows = {"convert": _summary(convert) | (_last_json(convert.stdout) if convert.ok else {})}
    if not convert.ok:
        return rows
    decode = run_capped(_python("bench.measure", "ours", "--model", str(model_dir), "--budget", budget,
                                "--store", "disk", "--format", FORMAT, "--fast-decode", "--threads", str(args.threads),
                                "--prompt-len", str(args.prompt_len), "--decode", str(args.decode)),
                        cap, timeout=args.timeout, env=env)
    rows["decode"] = _summary(decode)
    if decode.ok:
        measured = _last_json(decode.stdout)
        rows["decode"] |= {k: measured[k] for k in ("decode_tokens_per_s", "prefill_tokens_per_s", "budget_bytes",
                                                    "decode_hit_rate", "decode_bytes_per_token")}
        rows["decode"]["self_peak_rss_bytes"] = measured["peak_rss_bytes"]
    return rows


def run_llama(gguf: Path, cap: int, args, repack: bool) -> dict:
    """llama-bench from the mmap. With `repack` (its default on x86) it copies the K-quant weights it
    can into its own interleaved layout in anonymous memory at load; without, every weight is read
    from the mapping."""
    from bench.llamacpp import parse_llama_bench
    from bench.llamacpp_build import build_tools

    tool = build_tools(log=lambda m: print(m, file=sys.stderr)).tool("llama-bench")
    run = run_capped([str(tool), "-m", str(gguf), "-t", str(args.threads), "-r", "1", "-o", "json", "-lm", "mmap",
                      "--repack", str(int(repack)), "-p", "0", "-n", str(args.decode), "-d", str(args.prompt_len)], cap, timeout=args.timeout)
    row = _summary(run)
    if run.ok:
        row |= parse_llama_bench(run.stdout)
    return row


def _gib(nbytes: int | None) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes else "-"


def _line(step: str, row: dict, rate_key: str | None) -> str:
    result = f"{row['seconds']:.0f} s" if row.get("returncode") == 0 else row.get("error", "failed")[:80]
    rate = f"{row[rate_key]:.2f}" if rate_key and rate_key in row else "-"
    return (f"| {step} | {result} | {rate} | {_gib(row.get('peak_rss_bytes'))} | {_gib(row.get('group_peak_bytes'))} "
            f"| {row.get('limit_hits', '-')} | {'yes' if row.get('oom_killed') else 'no'} |")


def table(payload: dict) -> list[str]:
    a, rows = payload["args"], payload["rows"]
    lines = [f"Memory cap: {payload['shape']} ({payload['checkpoint_bytes'] / 1e9:.1f} GB in bf16), cap "
             f"{a['cap_gib']:g} GiB (cgroup v1 memory group: resident memory and page cache), {a['threads']} threads, "
             f"decode {a['decode']} tokens after a {a['prompt_len']}-token context; each step its own process and "
             f"group, a decode at most {a['timeout']} s, the first load {a['convert_timeout']} s.",
             f"Fit verdict at {FORMAT} for a machine with the cap as its RAM: {payload['verdict']}; budget "
             f"{payload['budget'] or 'none'}.", "",
             "| step | result | decode tok/s | own peak | group peak | limit reached (times) | OOM kill |",
             "|---|---|---|---|---|---|---|"]
    if "convert" in rows:
        lines.append(_line("MoEScope: first load, converting to Q4_K", rows["convert"], None))
    if "decode" in rows:
        lines.append(_line(f"MoEScope: decode, --budget {payload['budget']}, disk store", rows["decode"],
                           "decode_tokens_per_s"))
    for key, how in (("llama", "its default repack"), ("llama-norepack", "--repack 0")):
        if key in rows:
            lines.append(_line(f"llama.cpp: decode, {LLAMA_TYPE} from mmap, {how}", rows[key], "decode_tokens_per_s"))
    ours = rows.get("decode", {})
    for key in ("llama", "llama-norepack"):
        theirs = rows.get(key, {})
        if "decode_tokens_per_s" in ours and theirs.get("decode_tokens_per_s"):
            lines += ["", f"MoEScope's decode over llama.cpp's ({key}), side by side: "
                          f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x"]
    return lines


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    if argv is None and sys.argv[1:2] == ["convert-child"]:
        print(json.dumps(convert_in_this_process(sys.argv[2], sys.argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3moe-9g", help="a bench.large_checkpoint shape")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300, help="seconds each decode step may take")
    parser.add_argument("--convert-timeout", type=int, default=1200, help="seconds the first load may take")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"memcap: skipped: {reason}")
        return 0
    from bench.large_checkpoint import build_large

    model_dir = build_large(args.shape)
    cap = int(args.cap_gib * GiB)
    budget, headline = proposed_budget(model_dir, cap)
    # the conversions beside the checkpoints, one folder a shape (each run empties its own)
    env = {**os.environ, "XDG_CACHE_HOME": str(model_dir.parent / "memcap-xdg" / args.shape)}
    gguf = None if args.skip_llama else llama_gguf(model_dir)  # made before anything is measured
    rows = run_ours(model_dir, budget, cap, args, env) if budget else {}
    if gguf is not None:
        rows["llama"] = run_llama(gguf, cap, args, repack=True)
        rows["llama-norepack"] = run_llama(gguf, cap, args, repack=False)
    payload = {"shape": args.shape, "checkpoint_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
               "args": vars(args) | {"out": str(args.out)}, "cap_bytes": cap, "budget": budget, "verdict": headline,
               "rows": rows}
    write_report(args.out, "memcap", payload, table(payload))
    return 0


if __name__ == "__main__":
    from engine.system.process_exit import exit_process

    exit_process(main())
