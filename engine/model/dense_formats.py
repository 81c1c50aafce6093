"""Dense weights in a block format (mixed quantization: experts in one format, the rest in another).

Every plain linear layer of the model — attention projections, shared experts, dense MLPs, the LM
head — may be stored in a block format, except the routers (a few rows that decide which experts
run: kept as they are), an LM head tied to the embedding, and MLA's `kv_b_proj` (DeepSeek), which
the absorbed one-token attention (engine.decode.paths.latent_attention) reads per head as a matrix:
quantized, every token would dequantize it whole. Each becomes a `QuantizedLinear`
holding only its blocks; its forward computes with the dequantized weight (the reference values),
and the native decode paths read the blocks directly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.formats.blocks import BlockFormat, format_for
from engine.formats.dequantize import Dequantizer, reference_dequantizer
from engine.formats.quantize import quantize
from engine.model.layout import ROUTER_NAMES

KEPT_AS_IS = ("kv_b_proj",)  # see the module's docstring


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose [out, in] weight is stored as blocks of `fmt` (uint8 [out, row bytes])."""

    def __init__(self, linear: torch.nn.Linear, fmt: BlockFormat, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt, self.dtype = fmt, linear.weight.dtype
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias
        self.dequantizer: Dequantizer = reference_dequantizer  # the runtime may give a faster one, same values

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in the compute dtype (made on each access: for code that asks)."""
        out = torch.empty((self.out_features, self.in_features), dtype=self.dtype, device=self.packed.device)
        self.dequantizer(self.packed, self.fmt, self.in_features, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.device), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


def dense_targets(model: torch.nn.Module, expert_modules: set[str]) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers a dense format applies to, by name: not inside an experts module, not a
    router, not MLA's kv_b_proj, not an LM head that shares the embedding's weight."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    targets = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name.rpartition(".")[2] in (*ROUTER_NAMES, *KEPT_AS_IS):
            continue
        if any(name.startswith(path + ".") for path in expert_modules):
            continue
        if embedding is not None and module.weight is embedding:
            continue
        targets.append((name, module))
    return targets


def quantize_dense(model: torch.nn.Module, fmt: BlockFormat, expert_modules: set[str]) -> list[str]:
    """Replace the dense linear layers by `QuantizedLinear`s in `fmt` (llama.cpp's fallback format
    for narrow ones, as for experts); returns notes for the user."""
    fallbacks: dict[str, list[str]] = {}
    kept: list[str] = []
    for name, module in dense_targets(model, expert_modules):
        chosen = format_for(fmt, module.in_features)
        if chosen is None:
            kept.append(name)
            continue
        packed = torch.from_numpy(np.ascontiguousarray(quantize(module.weight.detach().float().cpu().numpy(), chosen)))
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf,
                QuantizedLinear(module, chosen, packed.to(module.weight.device)))
        if chosen is not fmt:
            fallbacks.setdefault(chosen.name, []).append(name)
    notes = [f"{len(names)} dense weights whose input features are not whole {fmt.block}-element blocks are stored "
             f"as {name} instead of {fmt.name}, as llama.cpp's quantizer does (e.g. '{names[0]}')"
             for name, names in fallbacks.items()]
    if kept:
        notes.append(f"{len(kept)} dense weights no block format fits stay in the original dtype (e.g. '{kept[0]}')")
    return notes
