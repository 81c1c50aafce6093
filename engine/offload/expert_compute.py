"""One expert's computation, following the flags of transformers' `@use_experts_implementation`.

`has_gate`, `has_bias`, `is_transposed` and `is_concatenated` (through the module's own
`_apply_gate`, which de-interleaves GPT-OSS's gate/up) are honoured exactly as transformers'
grouped/batched implementations do, so the result matches the stock model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.formats.blocks import BlockFormat
from engine.formats.dequantize import Dequantizer, reference_dequantizer
from engine.model.layout import ExpertParam
from engine.offload import packed_linear

# x [n, in] times a quantized slot's matrix [out, in] (its blocks, format and input features):
# F.linear on the dequantized matrix, within float32 summation order.
QuantizedProduct = Callable[[torch.Tensor, torch.Tensor, BlockFormat, int], torch.Tensor]


@dataclass(frozen=True)
class QuantizedMatrix:
    """A quantized slot's matrix left in its blocks, for a kernel that multiplies them directly."""

    blocks: torch.Tensor  # uint8 [out, row bytes], [out, in] whatever the module's layout
    fmt: BlockFormat
    columns: int
    dtype: torch.dtype  # of the products: the model's compute dtype
    product: QuantizedProduct

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x.to(self.dtype), self.blocks, self.fmt, self.columns)


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None, transposed: bool,
            packed: bool = False) -> torch.Tensor:
    if isinstance(weight, QuantizedMatrix):  # the bias after the product's rounding, as the torch path adds it
        return _with_bias(weight.linear(x), bias)
    if packed:  # pre-arranged for oneDNN when loaded (engine.offload.packed_linear): the same bits as F.linear
        return _with_bias(packed_linear.linear(x, weight), bias)
    return _with_bias(x @ weight if transposed else F.linear(x, weight), bias)


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out = out + bias
    return out


def expert_mlp(module: torch.nn.Module, x: torch.Tensor, weights: dict[str, torch.Tensor],
               packed: bool = False) -> torch.Tensor:
    """Run one expert on the rows `x` ([n, hidden]) with that expert's `weights` (views of a slot;
    `packed`: its matrices are pre-arranged for oneDNN, engine.offload.packed_linear)."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    w_in = weights[first]
    bias_in = weights.get(f"{first}_bias") if module.has_bias else None
    h = _linear(x.to(w_in.dtype), w_in, bias_in, module.is_transposed, packed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias_down = weights.get("down_proj_bias") if module.has_bias else None
    h = _linear(h, weights["down_proj"], bias_down, module.is_transposed, packed)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h


def weighted_sum(outputs: list[torch.Tensor], weights: torch.Tensor, out_dtype: torch.dtype,
                 dtype: torch.dtype) -> torch.Tensor:
    """One token's expert outputs (in pick order) times their routing weights, summed over picks:
    the same ops, in the same order, as the many-token path's scatter and sum."""
    weighted = torch.cat(outputs).to(out_dtype) * weights.unsqueeze(-1)
    return weighted.view(1, len(outputs), -1).sum(dim=1).to(dtype)


class SlotReader:
    """How an expert's weights come out of its slot for torch's kernels: as they are (views of the
    slot), pre-arranged for oneDNN (`packed`), or, for experts stored in a block format, dequantized
    into a reused scratch in the compute dtype: the values of the model with its experts
    dequantized (engine.formats.dequantize), one expert at a time."""

    def __init__(self, params: list[ExpertParam], dtype: torch.dtype, packed: bool = False,
                 dequantizer: Dequantizer = reference_dequantizer,
                 scratch: dict[str, torch.Tensor] | None = None) -> None:
        self.dtype, self.packed, self.dequantizer = dtype, packed, dequantizer
        self.quantized = {p.name: p for p in params if p.fmt is not None}
        self._scratch: dict[str, torch.Tensor] = {} if scratch is None else scratch

    @property
    def scratch_bytes(self) -> int:
        """One expert's quantized matrices dequantized, in the compute dtype."""
        return sum(p.rows_columns[0] * p.rows_columns[1] * self.dtype.itemsize for p in self.quantized.values())

    def with_params(self, params: list[ExpertParam]) -> SlotReader:
        """A reader of slots holding `params` (another layer's formats), sharing this one's scratch."""
        return SlotReader(params, self.dtype, self.packed, self.dequantizer, self._scratch)

    def plain(self, weights: dict[str, torch.Tensor],
              product: QuantizedProduct | None = None) -> dict[str, torch.Tensor | QuantizedMatrix]:
        """The expert's weights as its module reads them. Quantized ones are valid until the next call;
        with a `product`, they stay in their blocks and `product` multiplies them (expert_mlp)."""
        if not self.quantized:
            return weights
        plain = dict(weights)
        for name, p in self.quantized.items():
            if product is not None:
                plain[name] = QuantizedMatrix(weights[name], p.fmt, p.rows_columns[1], self.dtype, product)
                continue
            rows, columns = p.rows_columns
            buffer = self._scratch.get(name)
            if buffer is None or buffer.device != weights[name].device:
                buffer = self._scratch[name] = torch.empty((rows, columns), dtype=self.dtype, device=weights[name].device)
            self.dequantizer(weights[name], p.fmt, columns, buffer)
            plain[name] = buffer.t() if p.transposed else buffer
        return plain

    def grouped(self, views: dict[str, torch.Tensor], slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slots `slots` (an index tensor) of a layer's pool `views`, each param stacked as
        [len(slots), ...] in the layout its module reads (for `grouped_expert_mlp`): quantized ones
        dequantized together into a reused scratch (valid until the next call), the rest gathered.
        One dequantization per param for all the experts: on a GPU each call is a few dozen kernel
        launches, which one expert at a time cost more than its matmuls."""
        count, stacked = slots.numel(), {}
        for name, view in views.items():
            p = self.quantized.get(name)
            if p is None:
                stacked[name] = view[slots]
                continue
            rows, columns = p.rows_columns
            key = f"{name}/grouped"
            buffer = self._scratch.get(key)
            if buffer is None or buffer.device != view.device or buffer.shape[0] < count:
                buffer = self._scratch[key] = torch.empty((count, rows, columns), dtype=self.dtype, device=view.device)
            out = buffer[:count]
            self.dequantizer(view[slots].reshape(count * rows, -1), p.fmt, columns, out.view(count * rows, columns))
            stacked[name] = out.transpose(-2, -1) if p.transposed else out
        return stacked


class OneTokenExperts(Protocol):
    """How one decode token's experts run when every pick is resident: `chosen[i]` holds pick i's
    weights (views of its slot, read through `reader`), `weights` the routing weights in pick
    order; returns [1, hidden]. The expert cache is handed the kernel to use (a decode path may
    bring a faster one)."""

    def __call__(self, module: torch.nn.Module, hidden: torch.Tensor, chosen: list[dict[str, torch.Tensor]],
                 weights: torch.Tensor, out_dtype: torch.dtype, reader: SlotReader) -> torch.Tensor: ...


class LayerExperts(Protocol):
    """How a step's resident experts of one layer run on many rows at once (a prompt): `rows`
    [n, hidden] sorted by expert, expert i of `chosen` (its weights, views of its slot read through
    `reader`) taking rows [start[i], start[i] + count[i]). Returns [n, hidden] with those rows
    holding each expert's output before its routing weight, or None where it does not compute this
    module (the expert cache then runs the experts one by one)."""

    def __call__(self, module: torch.nn.Module, rows: torch.Tensor, start: list[int], count: list[int],
                 chosen: list[dict[str, torch.Tensor]], reader: SlotReader) -> torch.Tensor | None: ...


class CombineRows(Protocol):
    """A layer's expert outputs weighted and summed per token in one call: `y` [n, hidden] bf16 rows
    sorted by expert, `weights` [n] theirs (float32 or bf16), `order` [n] each sorted row's flat place
    (token * top_k + pick); returns [n / top_k, hidden] bf16, as the expert cache's weighting, scatter
    and sum."""

    def __call__(self, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class PromptKernels:
    """What a prompt path brings to the expert cache: a layer's resident experts in one call, for
    the experts that call leaves (and those computed as their bytes arrive) the product that
    multiplies a quantized slot's matrix in its blocks, and optionally the weighted sum of the
    outputs where the one call computed every row."""

    layer: LayerExperts
    product: QuantizedProduct
    combine: CombineRows | None = None


def torch_one_token(module: torch.nn.Module, hidden: torch.Tensor, chosen: list[dict[str, torch.Tensor]],
                    weights: torch.Tensor, out_dtype: torch.dtype, reader: SlotReader) -> torch.Tensor:
    """Each expert straight from its slot, in pick order: one-row `F.linear`s give the same bits as
    the grouped kernel's per-group matmuls, and the weighting and sum are the many-token path's
    ops, so the output equals transformers' while skipping the sorting, gathers and scatters."""
    outputs = [expert_mlp(module, hidden, reader.plain(weights_of), reader.packed) for weights_of in chosen]
    return weighted_sum(outputs, weights, out_dtype, hidden.dtype)


def grouped_available(weight: torch.Tensor) -> bool:
    """torch's grouped matmul (one kernel call for many experts) exists for this device and dtype."""
    return hasattr(F, "grouped_mm") and (weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) >= (8, 0))


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                    transposed: bool) -> torch.Tensor:
    # weight: the layer's whole slot pool [slots, out, in] (or [slots, in, out] when transposed);
    # `offsets` says which rows of x go to which slot, so slots without rows cost nothing.
    out = F.grouped_mm(x.to(weight.dtype), weight if transposed else weight.transpose(-2, -1), offs=offsets)
    if bias is not None:
        out = out + bias
    return out


def grouped_expert_mlp(module: torch.nn.Module, x: torch.Tensor, pool: dict[str, torch.Tensor],
                       offsets: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """Many experts at once, straight from the slot pool: `x` rows sorted by slot, `offsets` the
    cumulative row count per slot (int32, one per slot), `row_slots` each row's slot (for biases).

    The same grouped kernel transformers' `grouped_mm` implementation uses, so results match it.
    """
    first = "gate_up_proj" if module.has_gate else "up_proj"
    bias_in = pool[f"{first}_bias"][row_slots] if module.has_bias else None
    h = _grouped_linear(x, pool[first], offsets, bias_in, module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias_down = pool["down_proj_bias"][row_slots] if module.has_bias else None
    h = _grouped_linear(h, pool["down_proj"], offsets, bias_down, module.is_transposed)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h
