"""`python -m bench.policy_cost`: a cache policy's own bookkeeping per decode token, on real routing.

Replays the OLMoE-1B-7B trace (`bench.routing.OLMOE_TRACE`; qwen3moe-64e's geometry) through the
engine's own directory, as `moescope trace replay` does, and times every call into the policy
(access, victims, prefetch, admission, insert/evict, end of token): what a policy adds to an
offloaded decode token on top of the directory, which every policy shares. Minimum over
`--repeats` runs, as microseconds per token; compare with a decode token's time (`bench.run`).

    python -m bench.policy_cost [--policies lru,markov,crosslayer] [--budgets 25%,50%] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from bench.replay_table import real_traces
from engine.accounting.policies import make_policy
from engine.accounting.policies.base import CachePolicy
from engine.accounting.sizes import parse_budget
from engine.system.process_settings import apply_process_settings
from engine.traces.replay import plan_slots, replay, resolve_slots

HOOKS = ("reset", "on_request_start", "on_token_end", "set_capacity", "on_access", "on_prediction",
         "on_router_scores", "on_insert", "on_evict", "choose_victim", "prefetch", "admit_prefetch", "preferred")


class TimedPolicy(CachePolicy):
    """Runs `inner` and adds up the time spent in its hooks (`reset` excluded: it is once per load)."""

    def __init__(self, inner: CachePolicy) -> None:
        self.inner, self.seconds = inner, 0.0
        self.name, self.lookahead, self.needs_profile = inner.name, inner.lookahead, inner.needs_profile
        self.restricts_routing = inner.restricts_routing
        for hook in HOOKS:
            setattr(self, hook, self._timed(hook, getattr(inner, hook)))

    def _timed(self, hook: str, call: Callable) -> Callable:
        if hook == "reset":
            return call

        def timed(*args: object) -> object:
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def stats(self) -> dict[str, float]:
        self.inner.outcomes = self.outcomes
        return self.inner.stats()


def cost(spec: str, budget: str, repeats: int) -> float:
    """Microseconds of policy bookkeeping per decode token on the OLMoE trace, best of `repeats`."""
    traces, notes = real_traces()
    if "olmoe-1b-7b" not in traces:
        raise SystemExit(notes[0])
    trace = traces["olmoe-1b-7b"]
    slots, _ = plan_slots(trace, resolve_slots(trace, parse_budget(budget), None), "uniform")
    best = float("inf")
    for _ in range(repeats):
        timed = TimedPolicy(make_policy(spec))
        replay(trace, timed, slots)
        best = min(best, timed.seconds / trace.tokens)
    return best * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.policy_cost")
    parser.add_argument("--policies", default="lru,markov,crosslayer")
    parser.add_argument("--budgets", default="25%,50%")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("| policy | " + " | ".join(f"{b}: us per token" for b in args.budgets.split(",")) + " |")
    print("|---|" + "---|" * len(args.budgets.split(",")))
    for spec in args.policies.split(","):
        cells = " | ".join(f"{cost(spec, b, args.repeats):.0f}" for b in args.budgets.split(","))
        print(f"| {spec} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
