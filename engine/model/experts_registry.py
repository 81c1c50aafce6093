"""MoEScope's entry in transformers' experts-implementation registry.

Every experts class decorated with `@use_experts_implementation` dispatches its forward through
`ExpertsInterface`; models loaded with `experts_implementation="moescope"` call this function,
which hands the layer to whatever the runtime attached to the module (the expert cache: an
object with `run_layer(layer, module, hidden_states, top_k_index, top_k_weights)`). A module
with nothing attached was not offloaded and runs transformers' own forward.
"""

from __future__ import annotations

from importlib.metadata import version

import torch
from packaging.version import Version
from transformers.integrations.moe import ExpertsInterface

from engine.errors import MoEScopeError

IMPLEMENTATION_NAME = "moescope"
RUNTIME_ATTR = "_moescope_runtime"
# The decorator's flags the engine reads (`has_post_expert_norm`, `_is_expert_parallel`) are 5.24's;
# an older transformers would show every model as dense. pyproject.toml requires the same.
MIN_TRANSFORMERS = "5.24"


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


def check_transformers(installed: str | None = None) -> None:
    installed = installed or version("transformers")
    if Version(installed) < Version(MIN_TRANSFORMERS):
        raise MoEScopeError(f"transformers {installed} is older than the {MIN_TRANSFORMERS} MoEScope needs; "
                            f"upgrade it: pip install 'transformers>={MIN_TRANSFORMERS},<6'")


def register() -> None:
    check_transformers()
    ExpertsInterface.register(IMPLEMENTATION_NAME, moescope_experts_forward)
