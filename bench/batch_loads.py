"""Expert loads per generated token when replies decode together, on real routing (counts, no timing).

The real OLMoE-1B-7B decode trace (bench.routing.OLMOE_TRACE: 299 tokens, 16 layers of 64 experts,
top-8) is cut into `--streams` consecutive parts, one reply each, and replayed through the
accounting code (engine.traces.replay) at each budget with per-layer slots:
- in turn: one reply after another, each part a request of its own, one token a step;
- together: the replies' tokens side by side, each step the union of their experts (an expert that
  several picked is loaded once for all of them, as the engine's gathered step does).
Printed and written per lossless policy, and for Belady's MIN (the offline optimum: evict the expert
needed furthest in the future, which no online policy beats on the same slots): loads per generated
token both ways and their ratio, beside the union per layer against the picks (what the routing
shares). Where even Belady's optimum loads more together than in turn, no eviction policy over the
same per-layer slots makes replies decoding together load fewer experts a token than one after
another. The parts come from one request, so they share more than independent requests would.

    python -m bench.batch_loads [--streams 4] [--budgets 25%,50%]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.output import RESULTS_DIR, write_report
from bench.routing import OLMOE_TRACE
from engine.accounting.policies import POLICIES, make_policy
from engine.accounting.sizes import parse_budget
from engine.system.process_settings import apply_process_settings
from engine.traces.replay import belady_for, replay, resolve_slots
from engine.traces.trace import Trace, TraceStep, read_trace

KIND = "batch-loads"


def streams_of(trace: Trace, streams: int) -> list[list[list[list[int]]]]:
    """The trace's tokens cut into `streams` consecutive parts of equal length: [stream][token][layer] experts."""
    experts = {(s.token, s.layer): list(s.experts) for s in trace.steps}
    tokens = sorted({s.token for s in trace.steps})
    length = len(tokens) // streams
    return [[[experts[t, layer] for layer in range(trace.num_layers)] for t in tokens[i * length:(i + 1) * length]]
            for i in range(streams)]


def in_turn(trace: Trace, parts: list) -> Trace:
    """One reply after another, one token a step."""
    steps = [TraceStep(request, index, 1, layer, picks, [1] * len(picks), [1.0] * len(picks))
             for request, part in enumerate(parts) for index, token in enumerate(part)
             for layer, picks in enumerate(token)]
    return Trace(trace.num_layers, trace.num_experts, trace.top_k, steps)


def together(trace: Trace, parts: list) -> Trace:
    """The replies' tokens side by side: each step the union of their experts, with how many picked each."""
    steps = []
    for index in range(len(parts[0])):
        for layer in range(trace.num_layers):
            experts, counts = np.unique(np.concatenate([part[index][layer] for part in parts]), return_counts=True)
            steps.append(TraceStep(0, index * len(parts), len(parts), layer, experts.tolist(), counts.tolist(),
                                   counts.astype(float).tolist()))
    return Trace(trace.num_layers, trace.num_experts, trace.top_k, steps)


BELADY = "Belady's MIN (offline optimum)"


def loads_per_token(trace: Trace, policy_name: str, slots: list[int], profile: np.ndarray) -> float:
    policy = belady_for(trace) if policy_name == BELADY else make_policy(policy_name)
    result = replay(trace, policy, slots, profile=profile if policy.needs_profile else None)
    return result.loads / result.tokens


def measure(streams: int, budgets: list[str]) -> dict:
    trace = read_trace(OLMOE_TRACE, num_experts=64)
    parts = streams_of(trace, streams)
    turn, side = in_turn(trace, parts), together(trace, parts)
    # popularity-style policies get the counts of the routing they replay (an optimistic profile, the same both ways)
    profile = turn.activation_counts()
    union = float(np.mean([len(s.experts) for s in side.steps]))
    rows = []
    for budget in budgets:
        per_layer = resolve_slots(trace, parse_budget(budget), None) // trace.num_layers
        slots = [per_layer] * trace.num_layers
        for name in [*POLICIES, BELADY]:
            if name != BELADY and not make_policy(name).lossless:
                continue
            alone, batched = loads_per_token(turn, name, slots, profile), loads_per_token(side, name, slots, profile)
            rows.append({"budget": budget, "policy": name, "in_turn": alone, "together": batched,
                         "ratio": batched / alone})
    return {"streams": streams, "tokens_per_stream": len(parts[0]), "union_per_layer": union,
            "picks_per_layer": streams * trace.top_k, "rows": rows}


def report(result: dict) -> list[str]:
    n = result["streams"]
    lines = [f"Expert loads per generated token, {n} replies in turn against {n} decoding together: the real "
             f"OLMoE-1B-7B decode trace (../shared/traces, sqliteai/warp) cut into {n} replies of "
             f"{result['tokens_per_stream']} tokens, replayed with per-layer slots (`python -m bench.batch_loads "
             f"--streams {n}`). Together, a step's union is {result['union_per_layer']:.1f} experts a layer for "
             f"{result['picks_per_layer']} picks ({result['picks_per_layer'] / result['union_per_layer']:.2f} picks "
             "an expert).", "",
             "| budget | policy | loads a token, in turn | together | together / in turn |", "|---|---|---|---|---|"]
    lines += [f"| {r['budget']} | {r['policy']} | {r['in_turn']:.2f} | {r['together']:.2f} | {r['ratio']:.2f} |"
              for r in result["rows"]]
    optimum = [r for r in result["rows"] if r["policy"] == BELADY]
    above = [r["budget"] for r in optimum if r["ratio"] >= 1]
    if above:
        lines += ["", f"At {', '.join(above)} even Belady's optimum loads more experts a token together than in turn: "
                  "on this routing no eviction policy over the same per-layer slots makes the replies' sharing "
                  "outweigh the recent experts each reply reuses, which one reply alone keeps in all the slots."]
    return lines


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes (no timing here, but every program starts so)
    parser = argparse.ArgumentParser(prog="python -m bench.batch_loads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--budgets", default="25%,50%")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not OLMOE_TRACE.exists():
        print(f"the OLMoE trace is not here: {OLMOE_TRACE} (it lives in ../shared/traces beside the repository)")
        return 1
    result = measure(args.streams, args.budgets.split(","))
    write_report(args.out, KIND, result, report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
