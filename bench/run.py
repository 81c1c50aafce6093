"""`python -m bench.run [--quick] [--out DIR]`: speed and memory side by side, in one run.

Per model, prompt length, routing, budget and policy it measures, each in its own process:
- MoEScope (disk store; each policy of --policies, LRU by default) at the budget;
- (a) plain transformers, everything in memory, its best experts implementation;
- (b) transformers + accelerate big-model offloading at the same memory (device_map="auto",
  max_memory = dense + budget, disk offload folder) — what a Python user picks today;
- (c) MoEScope with no cache (every expert loaded on demand);
- the physical limit: Belady's minimum expert loads on the routing this very run saw (replayed
  through the engine's own cache code) divided by the link bandwidth measured in this run, plus
  the compute time measured at budget 100 %.
Routings: the model's own router (`random`: random weights), a synthetic trace with locality
(`trace`), or real routing (`olmoe`: OLMoE-1B-7B's, 299 decode tokens cycled; models of its
geometry only, e.g. qwen3moe-64e; others skip it and say why). Beside the hit rate every row shows
expert loads per token, ours and Belady's on the same routing.
Writes bench/results/[<label>-]<host>-<date>.{md,json} and a plot of decode tokens/s against budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bandwidth import disk_read_bandwidth, host_to_gpu_bandwidth, memory_read_bandwidth
from bench.routing import OLMOE_GEOMETRY, OLMOE_TRACE
from bench.synthetic import build_checkpoint
from engine.system.process_settings import apply_process_settings

RESULTS = Path(__file__).resolve().parent / "results"
def measure(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.measure", *args], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def belady_loads(trace_path: Path, slots_per_layer: list[int]) -> dict:
    """Belady's MIN on a recorded run's routing with these slots: its expert loads over the whole request,
    and those of them made in the decode steps."""
    from engine.traces.replay import belady_for, replay
    from engine.traces.trace import Trace, read_trace

    trace = read_trace(trace_path)
    whole = replay(trace, belady_for(trace), slots_per_layer)
    part = [[s for s in trace.steps if (s.tokens == 1) == decoding] for decoding in (False, True)]
    prompt, decode = (Trace(trace.num_layers, trace.num_experts, trace.top_k, steps) for steps in part)
    in_decode = replay(decode, belady_for(trace), slots_per_layer, history=prompt)
    return {"loads": whole.loads, "tokens": trace.tokens, "decode_loads": in_decode.loads,
            "decode_steps": decode.tokens}


def run(args) -> dict:
    names = args.models.split(",")
    prompts = [int(p) for p in args.prompts.split(",")]
    routings = args.routings.split(",")
    accelerate_prompts = {int(p) for p in args.accelerate_prompts.split(",")} if args.accelerate_prompts else set(prompts)
    threads = str(args.threads)
    report = {"host": platform.node(), "date": dt.datetime.now().isoformat(timespec="seconds"),
              "cpu": platform.processor() or platform.machine(), "threads": args.threads, "device": args.device,
              "gpu": gpu_name() if args.device == "cuda" else None,
              "decode_tokens": args.decode, "label": args.label, "rows": []}
    for name in names:
        if name == "demo":
            from resources import DEMO_MODEL_DIR

            path = DEMO_MODEL_DIR
        elif Path(name).is_dir():  # any checkpoint folder
            path, name = Path(name), Path(name).name
        else:
            path = build_checkpoint(name)
        files = sorted(path.glob("*.safetensors"))
        link = host_to_gpu_bandwidth() if args.device == "cuda" else disk_read_bandwidth(files)
        memory = memory_read_bandwidth(threads=args.threads)
        print(f"== {name}: {link_name(args.device)} {link / 1e9:.2f} GB/s, memory read {memory / 1e9:.1f} GB/s",
              flush=True)
        context = json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 1 << 30
        for prompt in prompts:
            if prompt + args.decode >= context:  # e.g. the demo model's 512-token context
                print(f"   prompt {prompt} + {args.decode} decode tokens do not fit the {context}-token context: skipped")
                continue
            common = ["--model", str(path), "--prompt-len", str(prompt), "--decode", str(args.decode),
                      "--threads", threads, "--device", args.device]
            stock = measure("stock", *common)
            for routing in routings:
                if routing == "olmoe" and (problem := olmoe_mismatch(path)):
                    print(f"   olmoe routing skipped: {problem}")
                    continue
                run_routing(args, report, name, prompt, routing, common, stock, link, memory, accelerate_prompts)
    return report


def limit(ours: dict, at_full: dict, belady: dict, link: float) -> dict:
    """What the physical limit allows: the compute time at 100 % plus Belady's bytes over the link,
    for the whole request and for decode alone (as tokens/s)."""
    slot = ours["slot_bytes"]
    time_s = at_full["total_s"] + belady["loads"] * slot / link
    decode_s = at_full["decode_s"] + belady["decode_loads"] * slot / link
    return {"belady_loads": belady["loads"], "belady_loads_per_token": belady["loads"] / belady["tokens"],
            "belady_bytes_per_token": belady["loads"] * slot / belady["tokens"],
            "belady_decode_loads_per_token": belady["decode_loads"] / max(1, belady["decode_steps"]),
            "time_s": time_s, "ours_time_s": ours["total_s"], "efficiency": time_s / ours["total_s"],
            "decode_tokens_per_s": belady["decode_steps"] / decode_s if decode_s else 0.0}


def olmoe_mismatch(path: Path) -> str | None:
    config = json.loads((path / "config.json").read_text())
    geometry = (config.get("num_hidden_layers"), config.get("num_experts") or config.get("num_local_experts"),
                config.get("num_experts_per_tok"))
    if geometry != OLMOE_GEOMETRY:
        return f"it is {OLMOE_GEOMETRY} (layers, experts, top-k), this model {geometry}"
    return None if OLMOE_TRACE.exists() else f"{OLMOE_TRACE} is absent (../shared beside the repository)"


def run_routing(args, report: dict, name: str, prompt: int, routing: str, common: list[str], stock: dict,
                link: float, memory: float, accelerate_prompts: set[int]) -> None:
    budgets = sorted((int(b) for b in args.budgets.split(",")), reverse=True)  # 100 % first: the limit's compute
    policies = [p for p in args.policies.split(",") if p.strip()]
    at_full = None
    for budget in budgets:
        for policy in policies[:1] if budget == 100 else policies:  # at 100 % nothing is evicted
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "routing.jsonl"
                ours = measure("ours", *common, *store_args(args), "--budget", f"{budget}%", "--routing", routing,
                               "--policy", policy, "--trace-out", str(trace))
                belady = belady_loads(trace, ours["slots_per_layer"]) if "error" not in ours else None
            if budget == 100:
                at_full = ours
            row = {"model": name, "prompt": prompt, "routing": routing, "policy": policy, "budget_pct": budget,
                   "link_bytes_per_s": link, "memory_bytes_per_s": memory, "moescope": ours, "transformers": stock}
            if belady and at_full and "error" not in at_full:
                row["limit"] = limit(ours, at_full, belady, link)
            if (routing == args.routings.split(",")[0] and policy == policies[0] and prompt in accelerate_prompts
                    and not args.skip_accelerate and "error" not in ours):
                cap = ours["dense_bytes"] + ours["budget_bytes"]
                row["accelerate"] = measure("accelerate", *common[:2], "--prompt-len", str(prompt),
                                            "--decode", str(min(args.decode, args.accelerate_decode)),
                                            "--threads", str(args.threads), "--device", args.device,
                                            "--max-memory-bytes", str(cap))
            report["rows"].append(row)
            print(summary_line(row), flush=True)
    nocache = measure("ours", *common, *store_args(args), "--budget", f"{min(budgets)}%", "--routing", routing,
                      "--no-cache")
    report["rows"].append({"model": name, "prompt": prompt, "routing": routing, "budget_pct": None,
                           "nocache": nocache})
    print(f"   no cache ({routing}): {nocache.get('decode_tokens_per_s', 0):.2f} tok/s", flush=True)


def store_args(args) -> list[str]:
    """On a GPU the cache lives in GPU memory and the store is pinned RAM (misses cross PCIe); on a
    CPU the store is the disk (misses are reads)."""
    return ["--store", "ram" if args.device == "cuda" else "disk"]


def link_name(device: str) -> str:
    return "RAM->GPU (pinned)" if device == "cuda" else "disk->RAM"


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def peak_memory(measured: dict, device: str) -> int:
    """What the budget is about: GPU memory on a GPU, resident RAM on a CPU."""
    return measured.get("peak_gpu_bytes", 0) if device == "cuda" else measured.get("peak_rss_bytes", 0)


def memory_name(device: str) -> str:
    return "GPU memory" if device == "cuda" else "RAM"


def where(report: dict) -> str:
    if report.get("device") == "cuda":
        return f"{report.get('gpu') or 'GPU'}, experts cached in GPU memory, pinned RAM store (misses cross PCIe)"
    return "CPU, disk store"


def routing_note(ours: dict, routing: str) -> str:
    rows, used = ours.get("routing_rows"), ours.get("routing_rows_used")
    if routing != "olmoe" or not rows:
        return ""
    return f" ({used} of {rows} tokens: cycled)" if used > rows else f" (first {used} of {rows} tokens)"


def summary_line(row: dict) -> str:
    ours = row["moescope"]
    if "error" in ours:
        return f"   {row['routing']:6s} {row['policy']:8s} {row['budget_pct']:3d}%: error {ours['error']}"
    acc = row.get("accelerate", {})
    limit = row.get("limit", {})
    eff = limit.get("efficiency")
    belady = (f", Belady {limit['belady_decode_loads_per_token']:.1f}; bound {limit['decode_tokens_per_s']:.2f} tok/s"
              if "decode_tokens_per_s" in limit else "")
    return (f"   {row['routing']:6s} {row['policy']:8s} {row['budget_pct']:3d}%: ours {ours['decode_tokens_per_s']:.2f} "
            f"tok/s (hit {ours['hit_rate']:.0%}, {ours.get('decode_loads_per_token', 0):.1f} loads/decode token{belady}), "
            f"transformers {row['transformers'].get('decode_tokens_per_s', 0):.2f}, "
            f"accelerate {acc.get('decode_tokens_per_s', float('nan')):.2f}, "
            f"limit/ours {eff if eff is None else round(eff, 2)}{routing_note(ours, row['routing'])}")


def write(report: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{report['label'] + '-' if report.get('label') else ''}{report['host'] or 'host'}-{report['date'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    device = report.get("device", "cpu")
    lines = [f"# MoEScope benchmark — {report['host']}, {report['date']}", "",
             f"{report['threads']} threads, {report['decode_tokens']} decode tokens, {where(report)}. "
             "Decode tokens/s; loads = experts loaded per decode token, Belady's beside ours; `bound "
             "tok/s` = decode tokens/s the limit allows (compute time at 100 % + Belady's decode loads over the "
             "link bandwidth of this run); `limit` = time the limit allows / our time for the whole request "
             "(1.00 = at the limit). `olmoe` routing: OLMoE-1B-7B's 299 real decode tokens (sqliteai/warp, "
             "Apache-2.0), cycled when a run needs more.", "",
             "| model | prompt | routing | policy | budget | MoEScope tok/s | hit rate | decode loads/token (Belady) | "
             f"bytes/token | stall | peak {memory_name(device)} | transformers (all in {memory_name(device)}) | "
             "accelerate offload | bound tok/s | "
             "limit eff. |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if row.get("budget_pct") is None:
            nc = row["nocache"]
            lines.append(f"| {row['model']} | {row['prompt']} | {row['routing']} | | no cache | "
                         f"{nc.get('decode_tokens_per_s', 0):.2f} | {nc.get('hit_rate', 0):.0%} | "
                         f"{nc.get('decode_loads_per_token', 0):.1f} | "
                         f"{nc.get('bytes_per_token', 0) / 2**20:.1f} MiB | {nc.get('stall_share', 0):.0%} | "
                         f"{peak_memory(nc, device) / 2**20:.0f} MiB | | | | |")
            continue
        ours, stock, acc = row["moescope"], row["transformers"], row.get("accelerate", {})
        if "error" in ours:
            lines.append(f"| {row['model']} | {row['prompt']} | {row['routing']} | {row['policy']} | "
                         f"{row['budget_pct']}% | error | | | | | | | | | |")
            continue
        lim = row.get("limit", {})
        eff, bound = lim.get("efficiency"), lim.get("decode_tokens_per_s")
        lines.append(
            f"| {row['model']} | {row['prompt']} | {row['routing']}{routing_note(ours, row['routing'])} | "
            f"{row['policy']} | {row['budget_pct']}% | "
            f"{ours['decode_tokens_per_s']:.2f} | {ours['hit_rate']:.0%} | "
            f"{ours['decode_loads_per_token']:.1f} ({lim.get('belady_decode_loads_per_token', float('nan')):.1f}) | "
            f"{ours['bytes_per_token'] / 2**20:.1f} MiB | "
            f"{ours['stall_share']:.0%} | {peak_memory(ours, device) / 2**20:.0f} MiB | "
            f"{stock.get('decode_tokens_per_s', float('nan')):.2f} ({peak_memory(stock, device) / 2**20:.0f} MiB) | "
            f"{acc.get('decode_tokens_per_s', float('nan')):.2f} ({peak_memory(acc, device) / 2**20:.0f} MiB) | "
            f"{'' if bound is None else f'{bound:.2f}'} | {'' if eff is None else f'{eff:.2f}'} |")
    lines += ["", *goal_lines(report)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(report, stem.with_suffix(".png"))
    return stem


def goal_lines(report: dict) -> list[str]:
    """Issue 8's goals as ratios per model, prompt and routing (misses are findings, not failures)."""
    lines = ["## Goals", "",
             "| model | prompt | routing | policy | ours/transformers at 100 % (goal >= 0.95) | ours/accelerate at 25 % "
             "(goal >= 5) | ours/limit time at 25 % (goal <= 1.5) | peak memory within dense + budget + 600 MiB |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [r for r in report["rows"] if r.get("budget_pct") is not None and "error" not in r["moescope"]]
    for key in sorted({(r["model"], r["prompt"], r["routing"], r["policy"]) for r in rows}, key=str):
        sel = {r["budget_pct"]: r for r in rows if (r["model"], r["prompt"], r["routing"]) == key[:3]
               and (r["policy"] == key[3] or r["budget_pct"] == 100)}  # 100 % runs once, with the first policy

        def ratio(num: float | None, den: float | None) -> str:
            return f"{num / den:.2f}" if num and den else "n/a"

        full, quarter = sel.get(100), sel.get(25)
        vs_stock = ratio(full["moescope"]["decode_tokens_per_s"], full["transformers"].get("decode_tokens_per_s")) if full else "n/a"
        vs_acc = (ratio(quarter["moescope"]["decode_tokens_per_s"], quarter["accelerate"].get("decode_tokens_per_s"))
                  if quarter and "accelerate" in quarter else "n/a")
        eff = quarter.get("limit", {}).get("efficiency") if quarter else None
        within = [peak_memory(r["moescope"], report.get("device", "cpu"))
                  <= r["moescope"]["dense_bytes"] + r["moescope"]["budget_bytes"] + 600 * 2**20
                  for r in sel.values()]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {vs_stock} | {vs_acc} | "
                     f"{'n/a' if not eff else f'{1 / eff:.2f}'} | {sum(within)}/{len(within)} budgets |")
    return lines


def plot(report: dict, target: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    rows = [r for r in report["rows"] if r.get("budget_pct") is not None and "error" not in r["moescope"]]
    panels = sorted({(r["model"], r["prompt"], r["routing"]) for r in rows})
    if not panels:  # every run failed: the table says why
        print("no run finished: no plot", file=sys.stderr)
        return
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    cols = min(4, len(panels))
    grid_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.2 * cols, 3.4 * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, panels, strict=False):
        sel = sorted((r for r in rows if (r["model"], r["prompt"], r["routing"]) == key), key=lambda r: r["budget_pct"])
        base = [r for r in sel if r["policy"] == policies[0]]  # the baselines do not depend on our policy
        x = [r["budget_pct"] for r in base]
        for policy in policies:
            mine = [r for r in sel if r["policy"] == policy or r["budget_pct"] == 100]
            ax.plot([r["budget_pct"] for r in mine], [r["moescope"]["decode_tokens_per_s"] for r in mine], "o-",
                    label=f"MoEScope ({policy})")
        ax.plot(x, [r["transformers"].get("decode_tokens_per_s", float("nan")) for r in base], "--",
                label=f"transformers (all in {memory_name(report.get('device', 'cpu'))})")
        if any("accelerate" in r for r in base):
            ax.plot(x, [r.get("accelerate", {}).get("decode_tokens_per_s", float("nan")) for r in base], "s-",
                    label="accelerate offload")
        ax.set_title(f"{key[0]}, prompt {key[1]}, {key[2]} routing", fontsize=9)
        ax.set_xlabel("budget (% of expert bytes)")
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.run")
    parser.add_argument("--quick", action="store_true", help="one small model, two budgets (< 5 minutes)")
    parser.add_argument("--models", default="qwen3moe-64e,mixtral-8e-12l,demo",
                        help="synthetic geometry names (bench.synthetic), 'demo', or checkpoint folders")
    parser.add_argument("--budgets", default="10,25,50,100")
    parser.add_argument("--prompts", default="128,512")
    parser.add_argument("--routings", default="random,trace",
                        help="random (the model's router), trace (synthetic locality), olmoe (real OLMoE-1B-7B routing, "
                        "cycled; qwen3moe-64e's geometry only)")
    parser.add_argument("--policies", default="lru", help="cache policies to run at each budget below 100 %%")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--accelerate-decode", type=int, default=16,
                        help="decode tokens for the accelerate baseline (it is slow; tokens/s is still per token)")
    parser.add_argument("--skip-accelerate", action="store_true")
    parser.add_argument("--accelerate-prompts", default="",
                        help="prompt lengths to run the (slow) accelerate baseline at (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the expert cache in GPU memory, a pinned RAM store, the limit over PCIe")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--label", default="", help="prefix of the results files (<label>-<host>-<date>.md)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.budgets, args.prompts, args.decode, args.accelerate_decode = (
            "qwen3moe-mini", "25,100", "128", 16, 8)
    stem = write(run(args), args.out)
    print(f"results: {stem}.md / .json / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
