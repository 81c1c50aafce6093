"""Replaying recorded expert choices in place of the router's (benchmarks only).

Random routers have no locality, so a cache benchmark on a synthetic checkpoint would be
meaningless without realistic routing. An override hands each MoE layer the next rows of a trace
`[tokens, layers, top_k]`; the router's weights are kept (only which experts run changes), so
the compute per token is the same as with the model's own routing. Output is then not the
model's own — this is for measuring speed and cache behaviour, never for chat.
"""

from __future__ import annotations

import numpy as np
import torch


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
