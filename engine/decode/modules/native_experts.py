"""The native experts kernels the native paths hand the expert cache: a layer's resident experts
of one token (`NativeExperts`) or of a prompt's rows (`NativePromptExperts`) in one native call,
rows times a quantized slot's matrix (`quantized_product`), and what those calls take from the
slots (`kernel_recipe`, `mixed_layout`, `expert_weights`, `expert_extras`), which the whole-token
step reads too.
"""

from __future__ import annotations

from functools import cache

import torch

from engine.decode.modules.expert_recipe import ExpertsRecipe, experts_recipe
from engine.decode.native import kernels as native
from engine.decode.native.library import Kernels
from engine.formats.blocks import BlockFormat
from engine.offload.expert_compute import QuantizedProduct, SlotReader, torch_one_token


class NativeExperts:
    """The one-token experts kernel of a native step: a layer's resident picks in one native call,
    for every experts module whose recipe the kernel computes (engine.decode.modules.expert_recipe:
    gated, with or without biases, halves or interleaved, [out, in] or transposed)."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def __call__(self, module: torch.nn.Module, hidden: torch.Tensor, chosen: list[dict[str, torch.Tensor]],
                 weights: torch.Tensor, out_dtype: torch.dtype, reader: SlotReader) -> torch.Tensor:
        recipe = kernel_recipe(module, reader, hidden)
        if recipe is None:
            return torch_one_token(module, hidden, chosen, weights, out_dtype, reader)
        gate_up, down = expert_weights(self.kernels, reader, chosen)
        if recipe.plain:
            return self.kernels.moe_decode(hidden, gate_up, down, weights)
        return self.kernels.moe_decode(hidden, gate_up, down, weights, *expert_extras(self.kernels, reader, chosen, recipe))


class NativePromptExperts:
    """A prompt's resident experts of one layer in one native call (`moe_prompt`), for the modules
    the one-token kernel also computes (engine.decode.modules.expert_recipe), laid out [out, in]."""

    def __init__(self, kernels: Kernels, int8_inputs: bool = False) -> None:
        self.kernels = kernels
        self.int8_inputs = int8_inputs  # opt-in, lossy: Q4_K matrices take their inputs rounded to 8 bits

    def __call__(self, module: torch.nn.Module, rows: torch.Tensor, start: list[int], count: list[int],
                 chosen: list[dict[str, torch.Tensor]], reader: SlotReader) -> torch.Tensor | None:
        recipe = kernel_recipe(module, reader, rows)
        if recipe is None:
            return None
        *biases, transposed, gate = expert_extras(self.kernels, reader, chosen, recipe)
        if transposed:  # bf16 matrices read as x @ W: the prompt kernel tiles [out, in] rows
            return None
        gate_up, down = expert_weights(self.kernels, reader, chosen)
        return self.kernels.moe_prompt(rows, start, count, gate_up, down, *biases, gate, self.int8_inputs)


def kernel_recipe(module: torch.nn.Module, reader: SlotReader, x: torch.Tensor) -> ExpertsRecipe | None:
    """The recipe the native experts kernels compute for `module` on these slots and input; None
    where they do not (an unrecognised recipe, a mixed layout, oneDNN-packed matrices, a non-bf16 input)."""
    recipe = experts_recipe(module)
    if isinstance(recipe, str) or mixed_layout(recipe, reader) or reader.packed or x.dtype != torch.bfloat16:
        return None
    return recipe


def mixed_layout(recipe: ExpertsRecipe, reader: SlotReader) -> bool:
    """One of a transposed module's matrices is quantized and the other not: quantized slots hold
    [out, in] blocks whatever the module's layout (engine.model.layout), so the two would need two
    layouts in one call."""
    return recipe.transposed and 0 < len(reader.quantized) < 2


def expert_extras(kernels: Kernels, reader: SlotReader, chosen: list[dict[str, torch.Tensor]],
                  recipe: ExpertsRecipe) -> tuple[list, list, bool, object]:
    """What the kernels take beside the matrices of the experts in `chosen`: their gate_up and down
    biases (or none), whether the matrices are read as x @ W, and their gate."""
    biases = ([w["gate_up_proj_bias"] for w in chosen], [w["down_proj_bias"] for w in chosen]) if recipe.bias \
        else ([], [])
    # quantized slots hold [out, in] blocks whatever the module's layout (engine.model.layout)
    return *biases, recipe.transposed and not reader.quantized, _gate(kernels, recipe)


@cache
def _gate(kernels: Kernels, recipe: ExpertsRecipe):
    return kernels.GateRecipe(recipe.interleaved, recipe.clamped_swiglu, recipe.alpha, recipe.limit)


def expert_weights(kernels: Kernels, reader: SlotReader, chosen: list[dict[str, torch.Tensor]]) -> tuple[list, list]:
    """The (gate_up, down) matrices of each expert in `chosen` (views of their slots), as the
    kernels take them: bf16, or blocks of the experts' format."""
    out = []
    for name in ("gate_up_proj", "down_proj"):
        param = reader.quantized.get(name)
        if param is None:
            out.append([native.weight(kernels, w[name]) for w in chosen])
        else:
            columns = param.rows_columns[1]
            out.append([native.weight(kernels, w[name], param.fmt, columns) for w in chosen])
    return out[0], out[1]


def quantized_product(kernels: Kernels) -> QuantizedProduct:
    """Rows times a quantized slot's matrix on the native kernels: each tile of the matrix is expanded
    once in L1 and multiplied by all rows (`linear_rows`), never the whole expert into a scratch."""

    def product(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, columns: int) -> torch.Tensor:
        return kernels.linear_rows(native.weight(kernels, blocks, fmt, columns), x)

    return product
