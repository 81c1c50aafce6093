"""The routers (gates) of a loaded model: for guessing ahead, and for SwapMoE's restricted routing.

In transformers 5 every MoE block keeps its router as a sibling of the experts module, named
`gate` or `router`, returning `(router_logits, top_k_weights, top_k_index)`. We use it two ways,
neither of which patches any model class:
- `RouterTaps.predict`: layer i+d's router applied to layer i's hidden state (the input of layer
  i's experts), called through `forward()` so no hooks fire (ProMoE / speculative loading);
- `RoutingRestriction`: a `register_forward_hook` on each router that rewrites its output so the
  experts module only ever sees resident experts (SwapMoE, lossy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.model.layout import ROUTER_NAMES, MoELayout


def find_routers(model: torch.nn.Module, layout: MoELayout) -> list[torch.nn.Module | None]:
    routers: list[torch.nn.Module | None] = []
    for path in layout.module_paths:
        block = model.get_submodule(path.rpartition(".")[0])
        found = None
        for name in ROUTER_NAMES:
            module = getattr(block, name, None)
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Module) and weight is not None and weight.shape[0] == layout.num_experts:
                found = module
                break
        routers.append(found)
    return routers


def _route(router: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    out = router.forward(hidden)  # forward(), not __call__: hooks must not see guesses
    if isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point():
        return out
    return None


class RouterTaps:
    def __init__(self, model: torch.nn.Module, layout: MoELayout) -> None:
        self.layout = layout
        self.routers = find_routers(model, layout)

    @property
    def available(self) -> bool:
        return all(r is not None for r in self.routers)

    def predict(self, layer: int, hidden: torch.Tensor, window: int) -> dict[int, list[int]]:
        """For d = 1..window: the experts layer+d's router picks on `hidden` (top-k by tokens, for a prefill)."""
        guesses: dict[int, list[int]] = {}
        for target in range(layer + 1, min(layer + window + 1, self.layout.num_layers)):
            router = self.routers[target]
            routed = _route(router, hidden) if router is not None else None
            if routed is None:
                continue
            index = routed[2]
            counts = torch.bincount(index.reshape(-1), minlength=self.layout.num_experts)
            top = torch.topk(counts, min(index.shape[-1], self.layout.num_experts)).indices
            guesses[target] = sorted(int(e) for e in top.tolist() if counts[e] > 0)
        return guesses


def reroute(
    logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, allowed: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Route among `allowed` experts only; returns (weights, index, router choices replaced).

    A token whose top-k are all allowed keeps its original routing bit for bit. Any other token
    takes the top-k allowed experts by logit, weighted by a softmax over those logits and scaled
    to the token's original routing mass (so families that do not normalise top-k weights, or
    scale them, keep their scale). This is SwapMoE's "router renormalised over the virtual experts".
    """
    k = index.shape[-1]
    allowed_t = torch.as_tensor(list(allowed), device=index.device, dtype=index.dtype)
    if allowed_t.numel() == 0:
        raise RuntimeError("no resident expert to route to")
    kept = torch.isin(index, allowed_t)
    replaced = int((~kept).sum())
    if replaced == 0:
        return weights, index, 0
    mask = torch.full((logits.shape[-1],), float("-inf"), device=logits.device)
    mask[allowed_t] = 0.0
    top_logits, new_index = (logits.float() + mask).topk(min(k, allowed_t.numel()), dim=-1)
    mass = weights.float().sum(dim=-1, keepdim=True)
    new_weights = torch.softmax(top_logits, dim=-1) * mass
    if new_index.shape[-1] == k:
        unchanged = kept.all(dim=-1, keepdim=True)
        new_index = torch.where(unchanged, index, new_index)
        new_weights = torch.where(unchanged, weights.float(), new_weights)
    return new_weights.to(weights.dtype), new_index.to(index.dtype), replaced


class RoutingRestriction:
    """Forward hooks on every router: the router may only choose `allowed(layer)` experts."""

    def __init__(self, taps: RouterTaps, allowed: Callable[[int], list[int]], policy) -> None:
        if not taps.available:
            raise RuntimeError("this model's routers were not found; restricted routing is not supported")
        self.allowed, self.policy = allowed, policy
        self._handles = [
            router.register_forward_hook(self._hook_for(layer)) for layer, router in enumerate(taps.routers)
        ]

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                return None
            logits, weights, index = output
            probs = torch.softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
            self.policy.on_router_scores(layer, probs.sum(dim=0).cpu().numpy())
            new_weights, new_index, replaced = reroute(logits.reshape(-1, logits.shape[-1]), weights, index,
                                                       self.allowed(layer))
            self.policy.note_rerouted(replaced, index.numel())
            return logits, new_weights, new_index

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
