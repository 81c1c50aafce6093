"""Replaying recorded expert choices in place of the router's (benchmarks only).

Random routers have no locality, so a cache benchmark on a synthetic checkpoint would be
meaningless without realistic routing. An override hands each MoE layer the next rows of a trace
`[tokens, layers, top_k]`; the router's weights are kept (only which experts run changes), so
the compute per token is the same as with the model's own routing. Output is then not the
model's own — this is for measuring speed and cache behaviour, never for chat.

The engine knows nothing of this: a benchmark hands `MoERuntime` one of the cache classes below
(`cache_type=`), which rewrite the routing or forget experts around the real `run_layer`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch

from engine.offload.expert_cache import ExpertCache

# Real routing: OLMoE-1B-7B's routers over 299 decode tokens (16 layers x 64 experts, top-8), from
# tests/trace_olmoe_299.jsonl of the public repository sqliteai/warp (Apache-2.0), kept beside the
# repository in ../shared (provenance in its README), not copied into it.
OLMOE_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "olmoe-1b-7b" / "trace_olmoe_299.jsonl"
OLMOE_GEOMETRY = (16, 64, 8)  # MoE layers, experts, top-k


class TraceRouting:
    def __init__(self, choices: np.ndarray) -> None:
        if choices.ndim != 3:
            raise ValueError("a routing trace is [tokens, layers, top_k]")
        self.choices = torch.from_numpy(np.ascontiguousarray(choices, dtype=np.int64))
        self.position = [0] * choices.shape[1]

    def __call__(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor:
        tokens = top_k_index.shape[0]
        start = self.position[layer]
        rows = torch.arange(start, start + tokens) % self.choices.shape[0]  # wraps around a short trace
        self.position[layer] = start + tokens
        picked = self.choices[rows, layer, : top_k_index.shape[1]]
        return picked.to(device=top_k_index.device, dtype=top_k_index.dtype)


def synthetic_locality_trace(tokens: int, layers: int, experts: int, top_k: int, *, seed: int = 0,
                             zipf: float = 1.0, stickiness: float = 0.5) -> np.ndarray:
    """Routing with the two properties real MoE traces show: skewed expert popularity per layer
    (Zipf) and temporal locality (each expert chosen for the previous token is kept with
    probability `stickiness`)."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    base = ranks ** -zipf
    out = np.zeros((tokens, layers, top_k), dtype=np.int64)
    for layer in range(layers):
        popularity = base[rng.permutation(experts)]  # each layer has its own favourites
        popularity /= popularity.sum()
        previous: list[int] = []
        for t in range(tokens):
            chosen = [e for e in previous if rng.random() < stickiness]
            while len(chosen) < top_k:
                e = int(rng.choice(experts, p=popularity))
                if e not in chosen:
                    chosen.append(e)
            out[t, layer] = chosen
            previous = chosen
    return out


def olmoe_choices(layers: int, experts: int, top_k: int) -> np.ndarray:
    """The OLMoE trace's decode routing as [299, layers, top_k] choices, for a model of its geometry."""
    from engine.traces.trace import read_trace

    if (layers, experts, top_k) != OLMOE_GEOMETRY:
        raise ValueError(f"the OLMoE routing is {OLMOE_GEOMETRY[0]} MoE layers x {OLMOE_GEOMETRY[1]} experts, "
                         f"top-{OLMOE_GEOMETRY[2]}; this model has {layers} x {experts}, top-{top_k} (use qwen3moe-64e)")
    if not OLMOE_TRACE.exists():
        raise ValueError(f"the OLMoE trace is not here: {OLMOE_TRACE} (it lives in ../shared/traces beside the repository)")
    trace = read_trace(OLMOE_TRACE, num_experts=experts)
    out = np.zeros((trace.tokens, layers, top_k), dtype=np.int64)
    for step in trace.steps:
        out[step.token, step.layer] = step.experts
    return out


class ReplayedRouting:
    """Cache mixin: each layer runs the experts a recorded trace names, not the router's."""

    def __init__(self, *args, routing: TraceRouting, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routing = routing

    def whole_token_problem(self) -> str | None:  # a whole token would run the router's own picks
        return "the benchmark replays recorded routing, layer by layer"

    def run_layer(self, layer, module, hidden_states, top_k_index, top_k_weights):
        return super().run_layer(layer, module, hidden_states, self.routing(layer, top_k_index), top_k_weights)


class Forgetful:
    """Cache mixin for the no-cache baseline: every expert is loaded on demand and dropped after its layer."""

    def whole_token_problem(self) -> str | None:
        return "the no-cache baseline drops every expert after its layer"

    def run_layer(self, layer, module, hidden_states, top_k_index, top_k_weights):
        out = super().run_layer(layer, module, hidden_states, top_k_index, top_k_weights)
        self.directory.drop_all(layer)
        return out


def bench_cache(*, choices: np.ndarray | None = None, forget: bool = False):
    """A `cache_type` for `MoERuntime`: replaying `choices` [tokens, layers, top_k] and/or forgetting."""
    bases = ([ReplayedRouting] if choices is not None else []) + ([Forgetful] if forget else [])
    if not bases:
        return ExpertCache
    cls = type("BenchCache", (*bases, ExpertCache), {})
    return partial(cls, routing=TraceRouting(choices)) if choices is not None else cls
