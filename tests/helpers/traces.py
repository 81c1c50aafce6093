"""Synthetic routing traces for replay, planner and policy tests (numpy only).

Real routing comes from the tiny checkpoints (tests/test_trace.py records some); these synthetic
ones have known structure: per-layer working sets of very different sizes (what the planner
exploits) and recurring request types (what MoE-Infinity's request matrices exploit).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from engine.traces.trace import Trace, TraceStep


def _step(request: int, token: int, layer: int, experts, predictions=None) -> TraceStep:
    experts = sorted(int(e) for e in experts)
    return TraceStep(request, token, 1, layer, experts, [1] * len(experts), [1.0 / len(experts)] * len(experts),
                     predictions or {})


def _draw(rng: np.random.Generator, p: np.ndarray, k: int) -> list[int]:
    return rng.choice(len(p), size=k, replace=False, p=p).tolist()


def skewed_trace(num_layers: int = 8, num_experts: int = 32, top_k: int = 2, tokens: int = 300, requests: int = 3,
                 seed: int = 0, expert_bytes: int = 1 << 20) -> Trace:
    """Layer l routes over a working set whose size grows from top_k to all experts, Zipf-weighted inside it."""
    rng = np.random.default_rng(seed)
    sizes = np.linspace(top_k + 1, num_experts, num_layers).astype(int)
    dists = []
    for size in sizes:
        members = rng.permutation(num_experts)[:size]
        p = np.zeros(num_experts)
        p[members] = 1.0 / np.arange(1, size + 1) ** 0.8
        dists.append(p / p.sum())
    steps = []
    per_request = tokens // requests
    for r in range(requests):
        for t in range(per_request):
            for layer in range(num_layers):
                steps.append(_step(r, t, layer, _draw(rng, dists[layer], top_k)))
    return Trace(num_layers, num_experts, top_k, steps, expert_bytes, {"synthetic": "skewed"})


def request_types_trace(num_layers: int = 6, num_experts: int = 32, top_k: int = 2, requests: int = 12,
                        tokens: int = 24, types: int = 3, seed: int = 1) -> Trace:
    """Requests of a few recurring types; each type routes to its own few experts per layer.

    Within a request the routing is stable, so a policy that recognises the request type early (a
    matched past request) knows the next layers' experts before they are asked for.
    """
    rng = np.random.default_rng(seed)
    favourites = rng.integers(0, num_experts, size=(types, num_layers, top_k + 2))
    steps = []
    for r in range(requests):
        kind = r % types
        for t in range(tokens):
            for layer in range(num_layers):
                pool = np.unique(favourites[kind, layer])
                pick = rng.choice(pool, size=min(top_k, len(pool)), replace=False)
                steps.append(_step(r, t, layer, pick))
    return Trace(num_layers, num_experts, top_k, steps, 4096, {"synthetic": "request-types"})


def write_csv(trace: Trace, path: Path) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["request", "token", "layer", "experts"])
        for s in trace.steps:
            writer.writerow([s.request, s.token, s.layer, " ".join(map(str, s.experts))])
    return path


def hand_trace() -> Trace:
    """One layer, top-1, experts 0 1 2 0 1 2 0 1 2: the textbook case where LRU with 2 slots always misses."""
    steps = [_step(0, t, 0, [e]) for t, e in enumerate([0, 1, 2] * 3)]
    return Trace(1, 4, 1, steps, 100, {"synthetic": "hand"})


def write_token_lines(trace: Trace, path: Path) -> Path:
    """One request of decode tokens in the per-token layer-lists shape of the OLMoE trace (no header)."""
    by_token: dict[int, list[list[int]]] = {}
    for s in trace.steps:
        by_token.setdefault(s.token, [[] for _ in range(trace.num_layers)])[s.layer] = s.experts
    path.write_text("".join(json.dumps({"tok": t + 1, "layers": layers}) + "\n" for t, layers in sorted(by_token.items())))
    return path


def cycle_trace(cycles: int = 20, length: int = 3) -> Trace:
    """One layer, top-1, experts 0 1 2 0 1 2 ...: through `length` - 1 slots LRU always evicts the expert
    needed next, while the expert that follows the one just used is perfectly predictable."""
    steps = [_step(0, t, 0, [t % length]) for t in range(cycles * length)]
    return Trace(1, length + 1, 1, steps, 100, {"synthetic": "cycle"})


def layer_pair_trace(tokens: int = 200, num_experts: int = 8, seed: int = 0) -> Trace:
    """Two layers, top-1: layer 0 picks at random, layer 1 always runs the partner of layer 0's pick.

    Nothing in layer 1's own history says what it needs next, but the layer below says it exactly."""
    rng = np.random.default_rng(seed)
    partner = rng.permutation(num_experts)
    steps = []
    for t in range(tokens):
        first = int(rng.integers(num_experts))
        steps += [_step(0, t, 0, [first]), _step(0, t, 1, [int(partner[first])])]
    return Trace(2, num_experts, 1, steps, 100, {"synthetic": "layer-pair"})
