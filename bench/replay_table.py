"""`python -m bench.replay_table`: every policy on every real routing trace, next to Belady's MIN.

Replays (no timing: the figures do not depend on the machine) the real OLMoE-1B-7B trace
(`bench.routing.OLMOE_TRACE`, skipped with a note where ../shared is absent) and the demo model's
recorded held-out traces (`bench/traces/`), at 25 % and 50 % of the experts, per-layer slots,
uniform allocation. The first quarter of each trace calibrates (whole requests, or the first
tokens of the one-request OLMoE trace) and is replayed unscored as every policy's warm-up; the
rest is scored (`engine.traces.replay.compare`).

Beside the table of every policy it writes the study behind `markov` and `crosslayer`: how often
a layer's experts repeat from one step to the next, decayed frequency at fixed decays on the
calibration part against the scored part (how routing drifts), markov and crosslayer without their
parts, an online bound (`NextStepOracle`: markov that also knows each layer's next step exactly),
and how the defaults were chosen: on the calibration parts alone (each split again, its first
third warming up). Writes bench/results/replay-real-traces-<date>[-label].{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.routing import OLMOE_TRACE
from engine.accounting.policies import POLICIES, make_policy
from engine.accounting.policies.markov import MarkovPolicy
from engine.accounting.routing import RoutingStep
from engine.accounting.sizes import format_bytes, parse_budget
from engine.system.process_settings import apply_process_settings
from engine.traces.replay import CALIBRATION, Comparison, belady_for, compare, plan_slots, replay, resolve_slots
from engine.traces.trace import Trace, read_trace

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = Path(__file__).resolve().parent / "traces"
BUDGETS = ("25%", "50%")
OLMOE_EXPERT_BYTES = 3 * 2048 * 1024 * 2  # OLMoE-1B-7B: hidden 2048, expert FFN 1024, bf16 gate/up/down
FIXED_DECAYS = (0.8, 0.9, 0.95, 0.98, 0.99)
ABLATIONS = ("markov:weight=0", "markov:decay=0.95", "markov:decay=0.98", "crosslayer:witnesses=0",
             "crosslayer:witnesses=8", "crosslayer:margin=0.8")
TUNING = ("lru", "lfu", "markov", "markov:weight=1", "markov:weight=0", "markov:memory=0.99", "markov:memory=0.9",
          "markov:decay=0.9", "markov:decay=0.95", "markov:decay=0.98", "markov:decay=0.99",
          "markov:decay=0.95,weight=1", "crosslayer", "crosslayer:witnesses=2", "crosslayer:witnesses=8",
          "crosslayer:margin=0.8", "crosslayer:margin=0.7", "crosslayer:witnesses=2,margin=0.8",
          "crosslayer:witnesses=2,margin=0.7", "crosslayer:witnesses=8,margin=0.8")


class NextStepOracle(MarkovPolicy):
    """A bound for online eviction: markov that also knows each layer's next step exactly (and evicts an
    expert that step does not need first). Replay only: it reads the future."""

    name = "next-step oracle"

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.future = belady_for(trace)  # the whole trace's steps: calibration replayed first, then scored

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, top_k)
        self.future.reset(num_layers, num_experts, top_k)

    def on_access(self, step: RoutingStep) -> None:
        super().on_access(step)
        self.future.on_access(step)

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        unneeded = [e for e in candidates if not self.future.needed_next(layer, e)]
        return super().choose_victim(layer, unneeded or list(candidates))


def next_step_bound(trace: Trace, budget: str) -> dict:
    """x hits / x loads of `NextStepOracle` against Belady's MIN, on the same split as `compare`."""
    calibration, scored = trace.split(CALIBRATION)
    slots, _ = plan_slots(calibration, resolve_slots(trace, parse_budget(budget), None), "uniform")
    best = replay(scored, belady_for(scored), slots)
    hits, loads = replay(scored, NextStepOracle(trace), slots, history=calibration).ratios(best)
    return {"hits": hits, "loads": loads}


def ranked_waves_study(trace: Trace, budget: str) -> dict:
    """Loads per token with a step's experts streamed through the slots in id order (the engine's
    waves) and in each policy's own order (`replay(ranked_waves=True)`), for Belady's MIN, lru and
    markov, on the same split as `compare`."""
    calibration, scored = trace.split(CALIBRATION)
    slots, _ = plan_slots(calibration, resolve_slots(trace, parse_budget(budget), None), "uniform")
    out = {}
    for ranked in (False, True):
        out[f"belady {'ranked' if ranked else 'ids'}"] = replay(scored, belady_for(scored), slots,
                                                                ranked_waves=ranked).loads_per_token
        for name in ("lru", "markov"):
            out[f"{name} {'ranked' if ranked else 'ids'}"] = replay(
                scored, make_policy(name), slots, history=calibration, ranked_waves=ranked).loads_per_token
    return out


def real_traces() -> tuple[dict[str, Trace], list[str]]:
    traces, notes = {}, []
    if OLMOE_TRACE.exists():
        trace = read_trace(OLMOE_TRACE, num_experts=64)
        trace.expert_bytes = OLMOE_EXPERT_BYTES
        traces["olmoe-1b-7b"] = trace
    else:
        notes.append(f"OLMoE trace absent ({OLMOE_TRACE}): not replayed")
    for path in sorted(TRACES.glob("demo-*.jsonl")):
        traces[path.stem] = read_trace(path)
    return traces, notes


def overlap(trace: Trace) -> float:
    """Mean share of a layer's experts (decode steps) that the same layer's next step picks again."""
    shares, previous = [], {}
    for step in trace.steps:
        if step.tokens != 1:
            previous.pop(step.layer, None)
            continue
        before = previous.get((step.request, step.layer))
        if before is not None:
            shares.append(len(before.intersection(step.experts)) / len(step.experts))
        previous[(step.request, step.layer)] = set(step.experts)
    return float(np.mean(shares)) if shares else 0.0


def row(c: Comparison) -> dict:
    p, b = c.policy, c.belady
    hits, loads = p.ratios(b)
    return {"policy": p.policy, "lossless": POLICIES[p.policy.split()[0].split(":")[0]].lossless,
            "hit_rate": p.hit_rate, "loads_per_token": p.loads_per_token, "bytes_per_token": p.bytes_per_token,
            "prefetch_loads": p.prefetch_loads, "rerouted": p.rerouted, "hit_rate_vs_belady": hits,
            "loads_vs_belady": loads, "belady_hit_rate": b.hit_rate, "belady_loads_per_token": b.loads_per_token,
            "belady_bytes_per_token": b.bytes_per_token, "scored_tokens": p.tokens, "calibration": c.calibration}


def measure(traces: dict[str, Trace]) -> dict:
    report = {"date": dt.date.today().isoformat(), "calibration": CALIBRATION, "allocation": "uniform",
              "policies": {}, "oracle": {}, "fixed_decay": {}, "ablations": {}, "overlap": {}, "tuning": {},
              "next_step": {}, "ranked_waves": {}}
    calibrations = {name: trace.split(CALIBRATION)[0] for name, trace in traces.items()}
    for spec in TUNING:  # on the calibration parts only: what chose markov's defaults
        runs = [row(compare(part, spec, parse_budget(b), calibrate=1 / 3, allocation="uniform"))
                for part in calibrations.values() for b in BUDGETS]
        report["tuning"][spec] = {"hits": float(np.mean([r["hit_rate_vs_belady"] for r in runs])),
                                  "loads": float(np.mean([r["loads_vs_belady"] for r in runs]))}
    for name, trace in traces.items():
        report["overlap"][name] = overlap(trace)
        calibration, _ = trace.split(CALIBRATION)
        for budget in BUDGETS:
            spec = parse_budget(budget)
            key = f"{name} {budget}"
            report["policies"][key] = [row(compare(trace, p, spec, allocation="uniform")) for p in POLICIES]
            report["oracle"][key] = row(compare(trace, "popularity", spec, allocation="uniform", oracle=True))
            report["ablations"][key] = [row(compare(trace, a, spec, allocation="uniform")) for a in ABLATIONS]
            report["next_step"][key] = next_step_bound(trace, budget)
            report["ranked_waves"][key] = ranked_waves_study(trace, budget)
            # LFU with decay, one decay at a time: on the calibration part itself (its first third warms
            # up) against the scored part. Where the best decay moves, routing drifts.
            report["fixed_decay"][key] = {
                str(d): {"calibration": row(compare(calibration, f"markov:weight=0,decay={d}", spec, calibrate=1 / 3,
                                                    allocation="uniform"))["hit_rate_vs_belady"],
                         "scored": row(compare(trace, f"markov:weight=0,decay={d}", spec,
                                               allocation="uniform"))["hit_rate_vs_belady"]}
                for d in FIXED_DECAYS}
            print(f"{key}: " + ", ".join(f"{r['policy']} {r['hit_rate_vs_belady']:.3f}/{r['loads_vs_belady']:.3f}"
                                         for r in report["policies"][key]), flush=True)
    return report


def markdown(report: dict, traces: dict[str, Trace], notes: list[str]) -> str:
    def traffic(value: float | None) -> str:
        return "" if value is None else format_bytes(value)

    lines = [f"# Policies on real routing — replay, {report['date']}", "",
             "`python -m bench.replay_table`. Per-layer slots, uniform allocation, 25 % and 50 % of the experts. "
             f"The first {report['calibration']:.0%} of each trace calibrates (warm-up of every policy, popularity's "
             "profile) and is not scored; `x hits` / `x loads` are the policy's hit rate and loads per token over "
             "Belady's MIN on the same scored tokens (MIN from the best possible cache). Traffic: OLMoE-1B-7B's "
             f"bf16 expert is {format_bytes(OLMOE_EXPERT_BYTES)}, the demo model's float32 expert 384 KiB.", ""]
    lines += [f"- {n}" for n in notes]
    for name, trace in traces.items():
        lines.append(f"- `{name}`: {trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}, "
                     f"{trace.requests} request(s), {trace.tokens} tokens; a layer's next decode step repeats "
                     f"{report['overlap'][name]:.0%} of its experts")
    lines += ["", "| trace | budget | policy | hit rate | loads/token | traffic/token | x hits | x loads | "
              "Belady hit rate | Belady loads/token |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, rows in report["policies"].items():
        name, budget = key.rsplit(" ", 1)
        for r in [*rows, report["oracle"][key]]:
            label = r["policy"] + ("" if r["lossless"] else " (lossy)")
            best = max((x for x in rows if x["lossless"] and not x["prefetch_loads"]),
                       key=lambda x: x["hit_rate_vs_belady"])
            mark = "**" if r is best else ""
            lines.append(f"| {name} | {budget} | {mark}{label}{mark} | {r['hit_rate']:.1%} | {r['loads_per_token']:.2f} | "
                         f"{traffic(r['bytes_per_token'])} | {r['hit_rate_vs_belady']:.3f} | {r['loads_vs_belady']:.3f} | "
                         f"{r['belady_hit_rate']:.1%} | {r['belady_loads_per_token']:.2f} |")
    lines += ["", "Bold: the best lossless demand-only policy (no prefetch) of the row group. `swapmoe` is lossy "
              "(it reroutes instead of loading), `popularity (oracle)` is calibrated on the scored routing itself "
              "(the old default; no user can have that profile). The prefetching policies (`crosslayer`, `eam`, "
              "`promoe`) buy hit rate with loads: a prefetch is a hit when it is used (the replay assumes it arrives "
              "in time) and a load whether it is used or not.", "",
              "## Study: drift (decayed frequency at fixed decays, x hits)", "",
              "| trace | budget | " + " | ".join(f"decay {d}: calibration / scored" for d in FIXED_DECAYS) + " |",
              "|---|---|" + "---|" * len(FIXED_DECAYS)]
    for key, by_decay in report["fixed_decay"].items():
        name, budget = key.rsplit(" ", 1)
        cells = " | ".join(f"{v['calibration']:.3f} / {v['scored']:.3f}" for v in by_decay.values())
        lines.append(f"| {name} | {budget} | {cells} |")
    lines += ["", "## Study: markov and crosslayer without their parts (x hits / x loads)", "",
              "| trace | budget | markov | crosslayer | " + " | ".join(ABLATIONS) + " |",
              "|---|---|---|---|" + "---|" * len(ABLATIONS)]
    for key, rows in report["ablations"].items():
        name, budget = key.rsplit(" ", 1)
        whole = [next(r for r in report["policies"][key] if r["policy"] == p) for p in ("markov", "crosslayer")]
        cells = " | ".join(f"{r['hit_rate_vs_belady']:.3f} / {r['loads_vs_belady']:.3f}" for r in [*whole, *rows])
        lines.append(f"| {name} | {budget} | {cells} |")
    lines += ["", "## Study: an online bound (x hits / x loads)", "",
              "`next-step oracle`: markov that also knows each layer's next step exactly (it evicts an expert that "
              "step does not need first). No online policy knows that much; where even it stays far from Belady's "
              "loads, so will every online policy that only evicts.", "",
              "| trace | budget | markov | next-step oracle |", "|---|---|---|---|"]
    for key, bound in report["next_step"].items():
        name, budget = key.rsplit(" ", 1)
        markov = next(r for r in report["policies"][key] if r["policy"] == "markov")
        lines.append(f"| {name} | {budget} | {markov['hit_rate_vs_belady']:.3f} / {markov['loads_vs_belady']:.3f} | "
                     f"{bound['hits']:.3f} / {bound['loads']:.3f} |")
    lines += ["", "## Study: which of a step's experts stay (loads per token)", "",
              "A step that needs more experts than a layer has slots (a prompt) streams them through the slots in "
              "waves. `ranked` (the engine since 2026-11-28, and every table above, Belady's MIN included): in the "
              "policy's order, least wanted first, the resident ones it wants most held through the waves "
              "(`CacheDirectory.wave_order`), so what stays is the policy's choice. `ids`: in expert id order, as "
              "before, when the last wave stayed whatever it held. The last column: the id order's loads against "
              "ranked Belady, where the engine stood against the tighter bound.", "",
              "| trace | budget | Belady ids | Belady ranked | lru ids / ranked | markov ids / ranked | "
              "x loads vs ranked Belady: lru ids, markov ids |", "|---|---|---|---|---|---|---|"]
    for key, w in report["ranked_waves"].items():
        name, budget = key.rsplit(" ", 1)
        tight = w["belady ranked"]
        lines.append(f"| {name} | {budget} | {w['belady ids']:.3f} | {tight:.3f} | {w['lru ids']:.3f} / "
                     f"{w['lru ranked']:.3f} | {w['markov ids']:.3f} / {w['markov ranked']:.3f} | "
                     f"{w['lru ids'] / tight:.3f}, {w['markov ids'] / tight:.3f} |")
    lines += ["", "## How the defaults were chosen: the calibration parts only", "",
              "Each trace's calibration part split again (its first third warms up, the rest is scored); the mean "
              "over the traces and both budgets of x hits and x loads. No scored routing is involved.", "",
              "| policy | mean x hits | mean x loads |", "|---|---|---|"]
    lines += [f"| {spec} | {v['hits']:.4f} | {v['loads']:.4f} |" for spec, v in report["tuning"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.replay_table")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--label", default="", help="e.g. after-crosslayer: named in the file name")
    args = parser.parse_args(argv)
    traces, notes = real_traces()
    report = measure(traces)
    report["notes"] = notes
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "-".join(filter(None, ("replay-real-traces", report["date"], args.label)))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report, traces, notes))
    print(f"results: {stem}.md / .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
