"""`moescope trace replay`: a recorded routing trace through any policy, with Belady's MIN beside it.

Kept out of engine/cli/main.py so the CLI stays small; numpy only (no torch), so replays start
instantly.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.traces.replay import CALIBRATION


def add_trace_parser(sub) -> None:
    trace = sub.add_parser("trace", help="replay recorded routing traces (see README: Traces)")
    actions = trace.add_subparsers(dest="trace_command")
    rp = actions.add_parser(
        "replay", help="hit rate and traffic of a policy on a trace, next to Belady's offline optimum",
        description="Replays FILE (a MoEScope JSON-lines trace, a per-token layer-lists trace such as the OLMoE one, "
        "or a CSV 'request,token,layer,experts') through the engine's own cache directory and policy code. The first "
        f"part of the trace (--calibrate, {CALIBRATION:.0%} by default: whole requests, or the first tokens of a "
        "one-request trace) calibrates and warms every policy and is not scored; the rest is scored, the same tokens "
        "for every policy and for Belady. Budgets and policies may be comma-separated lists; '--policy all' runs "
        "every policy.",
    )
    rp.add_argument("file", help="trace file (.jsonl from --trace, a per-token layer-lists .jsonl, or CSV)")
    rp.add_argument("--policy", default="lru", help="policy name (options after a colon: promoe:k=3), a list, or 'all'")
    rp.add_argument("--budget", default="25%", help="cache size per budget: 25%%, 64slots, 512MiB (needs expert bytes), all")
    rp.add_argument("--allocation", default="planned", choices=["planned", "uniform"],
                    help="split slots across layers by the calibration part's miss curves, or evenly")
    rp.add_argument("--calibrate", default=f"{CALIBRATION:.0%}", type=_share, metavar="SHARE",
                    help="share of the trace that calibrates and is not scored (default %(default)s; 0 scores all of "
                    "it, and then a policy that needs a profile needs --profile or --oracle)")
    rp.add_argument("--profile", default=None, metavar="TRACE",
                    help="profile-needing policies (popularity): build the profile from this trace instead of the "
                    "calibration part; refused if it holds the routing being scored")
    rp.add_argument("--oracle", action="store_true",
                    help="build that profile from the scored routing itself (knows the future; labelled '(oracle)')")
    rp.add_argument("--expert-bytes", type=int, default=None, help="bytes of one expert (default: from the trace header)")
    rp.add_argument("--num-layers", type=int, default=None, help="CSV traces: MoE layers")
    rp.add_argument("--num-experts", type=int, default=None, help="CSV traces: experts per layer; per-token layer-lists traces: overrides the count taken "
                    "from the ids (the highest + 1)")
    rp.add_argument("--top-k", type=int, default=None, help="CSV traces: experts per token (default: the widest row)")
    rp.add_argument("--json", action="store_true", help="print JSON (one object, or a list for several runs)")


def _share(text: str) -> float:
    value = text.strip()
    try:
        share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a share: write e.g. 25% or 0") from None
    if not 0 <= share < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 0 % and below 100 %")
    return share


def run_trace(args: argparse.Namespace) -> int:
    from engine.errors import MoEScopeError

    if args.trace_command != "replay":
        raise MoEScopeError("say what to do with the trace: moescope trace replay FILE --policy NAME --budget SIZE")
    from engine.accounting.policies import POLICIES, parse_policy
    from engine.accounting.sizes import parse_budget
    from engine.traces.replay import compare
    from engine.traces.trace import TraceError, read_trace

    try:
        trace = read_trace(args.file, num_layers=args.num_layers, num_experts=args.num_experts, top_k=args.top_k)
        profile = read_trace(args.profile, num_layers=trace.num_layers, num_experts=trace.num_experts,
                             top_k=trace.top_k) if args.profile else None
    except TraceError as exc:
        raise MoEScopeError(str(exc)) from None
    if note := trace.meta.get("note"):  # a geometry taken from the data, not from the user
        print(f"moescope: note: {note}", file=sys.stderr)
    policies = list(POLICIES) if args.policy.strip() == "all" else [p.strip() for p in args.policy.split(",") if p.strip()]
    for spec in policies:
        parse_policy(spec)  # a bad name fails before any replay runs
    budgets = [parse_budget(b) for b in args.budget.split(",") if b.strip()]
    runs = []
    for budget in budgets:
        for spec in policies:
            try:
                runs.append(compare(trace, spec, budget, calibrate=args.calibrate, allocation=args.allocation,
                                    expert_bytes=args.expert_bytes, profile=profile, oracle=args.oracle))
            except ValueError as exc:
                raise MoEScopeError(str(exc)) from None
    if args.json:
        out = [r.as_dict() | {"policy_spec": spec} for r, spec in zip(runs, policies * len(budgets), strict=True)]
        print(json.dumps(out[0] if len(out) == 1 else out))
    else:
        print(format_table(runs))
    return 0


def format_table(runs) -> str:
    """Hit rate and traffic per token of each run, and both as a ratio to Belady's MIN beside it."""
    def traffic(result) -> str:
        b = result.bytes_per_token
        if b is None:
            return "-"
        from engine.accounting.sizes import format_bytes

        return format_bytes(b)

    first = runs[0]
    lines = [f"scored: {first.policy.tokens} tokens after {first.calibration}, which calibrated "
             "(not scored; every policy's warm-up, profiles and planned allocation come from it)"]
    head = (f"{'policy':<20} {'budget':>8} {'slots':>6} {'alloc':>8} {'hit rate':>9} {'pred':>6} {'loads/tok':>9} "
            f"{'traffic/tok':>12} {'x hits':>7} {'x loads':>7} | {'belady hit':>10} {'loads/tok':>9} {'traffic/tok':>12}")
    lines += [head, "-" * len(head)]
    for r in runs:
        p, b = r.policy, r.belady
        hits, loads = p.ratios(b)
        pred = f"{r.predicted_hit_rate:.0%}" if r.predicted_hit_rate is not None else "-"
        note = f"  ({p.rerouted} rerouted: lossy)" if p.rerouted else ""
        lines.append(
            f"{p.policy:<20} {r.budget:>8} {sum(p.slots_per_layer):>6} {r.allocation:>8} {p.hit_rate:>9.1%} {pred:>6} "
            f"{p.loads_per_token:>9.2f} {traffic(p):>12} {hits:>7.3f} {loads:>7.3f} | {b.hit_rate:>10.1%} "
            f"{b.loads_per_token:>9.2f} {traffic(b):>12}{note}"
        )
    lines.append("x hits / x loads: the policy's hit rate and loads per token over Belady's on the same scored tokens")
    return "\n".join(lines)
