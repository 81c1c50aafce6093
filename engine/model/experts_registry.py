"""MoEScope's entry in transformers' experts-implementation registry.

Every experts class decorated with `@use_experts_implementation` dispatches its forward through
`ExpertsInterface`; models loaded with `experts_implementation="moescope"` call this function,
which hands the layer to whatever the runtime attached to the module (the expert cache: an
object with `run_layer(layer, module, hidden_states, top_k_index, top_k_weights)`). A module
with nothing attached was not offloaded and runs transformers' own forward.
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
    if runtime is None:  # not offloaded (experts of another shape than the main stack's): its weights are here
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    cache, layer = runtime
    return cache.run_layer(layer, self, hidden_states, top_k_index, top_k_weights)


def attach(module: torch.nn.Module, cache, layer: int) -> None:
    """Route `module`'s forward (MoE layer `layer`) to `cache`."""
    setattr(module, RUNTIME_ATTR, (cache, layer))


def register() -> None:
    ExpertsInterface.register(IMPLEMENTATION_NAME, moescope_experts_forward)
