"""Which experts modules the native experts kernel computes, recognised by structure, not by class.

An experts module decorated with `@use_experts_implementation` says how it is laid out through the
decorator's flags (`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`); what is left
is the gate: transformers' default `_apply_gate` (gate and up as two halves, `act_fn(gate) * up`)
with a SiLU act, or a module's own `_apply_gate`. An own gate qualifies when it carries GPT-OSS's
parameters (`alpha`, `limit`) and computes, on a probe of values around its clamp, exactly the
clamped SwiGLU of interleaved gate/up rows the kernel computes (`GateRecipe`). Everything else
keeps transformers' kernels, with the reason in words (`experts_problem`).

The recipe is decided once per module: it is asked every layer of every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertsRecipe:
    """How the kernel computes one experts module: layout, biases and gate."""

    transposed: bool  # matrices read as x @ W ([in, out])
    bias: bool  # gate_up and down biases
    interleaved: bool  # gate at even gate_up rows, up at odd (GPT-OSS)
    clamped_swiglu: bool  # GPT-OSS's (clamp(up) + 1) * g * sigmoid(alpha * g), else SiLU(gate) * up
    alpha: float = 1.0
    limit: float = 0.0

    @property
    def plain(self) -> bool:
        """SiLU-gated gate_up/down [out, in] matrices without biases (the whole-token step's experts)."""
        return not (self.transposed or self.bias or self.interleaved or self.clamped_swiglu)


def experts_recipe(module: torch.nn.Module) -> ExpertsRecipe | str:
    """The module's recipe, or why the native experts kernel does not compute it (in words)."""
    found = module.__dict__.get("_moescope_recipe")
    if found is None:
        found = module.__dict__["_moescope_recipe"] = _recognise(module)
    return found


def experts_problem(module: torch.nn.Module) -> str:
    """Why the native experts kernel does not compute this module ("" when it does)."""
    found = experts_recipe(module)
    return found if isinstance(found, str) else ""


def _recognise(module: torch.nn.Module) -> ExpertsRecipe | str:
    from transformers.integrations import moe

    name = type(module).__name__
    if not hasattr(module, "has_gate"):
        return f"{name} is not a transformers experts module (no @use_experts_implementation flags)"
    if not module.has_gate:
        return f"{name} has no gate (up, act, down experts)"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} norms each expert's output"
    layout = dict(transposed=bool(module.is_transposed), bias=bool(module.has_bias))
    if getattr(type(module), "_apply_gate", None) is moe._default_apply_gate:
        act = getattr(module, "act_fn", None)
        if not isinstance(act, _silu_classes()):
            return f"experts use act {type(act).__name__}; the native kernel computes SiLU"
        return ExpertsRecipe(**layout, interleaved=False, clamped_swiglu=False)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, int | float) or not isinstance(limit, int | float):
        return f"{name} gates its experts with its own code (_apply_gate)"
    recipe = ExpertsRecipe(**layout, interleaved=True, clamped_swiglu=True, alpha=float(alpha), limit=float(limit))
    if not _gate_matches(module, recipe):
        return f"{name}'s own gate (_apply_gate) is not the clamped SwiGLU the native kernel computes"
    return recipe


def _silu_classes() -> tuple[type, ...]:
    from transformers.activations import SiLUActivation

    return (SiLUActivation, torch.nn.SiLU)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gate over interleaved gate/up rows, op by op as the kernel rounds it (bf16)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _gate_matches(module: torch.nn.Module, recipe: ExpertsRecipe) -> bool:
    """The module's own gate gives the recipe's bits on values spread across its clamp."""
    generator = torch.Generator().manual_seed(0)
    spread = max(recipe.limit, 1.0) * 2
    probe = ((torch.rand(4, 64, generator=generator) * 2 - 1) * spread).to(torch.bfloat16)
    with torch.no_grad():
        ours = clamped_swiglu(probe, recipe.alpha, recipe.limit)
        theirs = module._apply_gate(probe)
    return theirs.shape == ours.shape and torch.equal(theirs, ours)
