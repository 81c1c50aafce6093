"""MoEScope's entry in transformers' experts-implementation registry.

Every experts class decorated with `@use_experts_implementation` dispatches its forward through
`ExpertsInterface`; models loaded with `experts_implementation="moescope"` call this function,
which hands the layer to the expert cache attached to the module by the loader.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface

IMPLEMENTATION_NAME = "moescope"
RUNTIME_ATTR = "_moescope_runtime"


def moescope_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    runtime = getattr(self, RUNTIME_ATTR, None)
    if runtime is None:
        raise RuntimeError("this experts module was not loaded by MoEScope's loader (no expert cache attached)")
    cache, layer = runtime
    override = getattr(cache, "routing_override", None)
    if override is not None:  # benchmarks replaying recorded routing (engine.routing_override)
        top_k_index = override(layer, top_k_index)
    return cache.run_layer(layer, self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    ExpertsInterface.register(IMPLEMENTATION_NAME, moescope_experts_forward)
