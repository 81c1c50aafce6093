"""One expert's computation, following the flags of transformers' `@use_experts_implementation`.

`has_gate`, `has_bias`, `is_transposed` and `is_concatenated` (through the module's own
`_apply_gate`, which de-interleaves GPT-OSS's gate/up) are honoured exactly as transformers'
grouped/batched implementations do, so the result matches the stock model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    if bias is not None:
        out = out + bias
    return out


def expert_mlp(module: torch.nn.Module, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run one expert on the rows `x` ([n, hidden]) with that expert's `weights` (views of a slot)."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    w_in = weights[first]
    h = _linear(x.to(w_in.dtype), w_in, weights.get(f"{first}_bias") if module.has_bias else None, module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    h = _linear(h, weights["down_proj"], weights.get("down_proj_bias") if module.has_bias else None, module.is_transposed)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h
