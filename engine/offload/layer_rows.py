"""One MoE layer's routing and routed rows in one forward step, computed expert by expert as their
bytes come in.

`LayerRouting` is the routing brought to the host once and summarised. The expert cache
(`ExpertCache._compute`) decides the order — resident, on the CPU, in flight, in waves — and hands
each expert's slot to `LayerRows`, which holds what the step computes on: the hidden states and
routing, the rows gathered once in expert order, which parts of that order have their outputs, and
the layer's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.accounting.routing import RoutingStep
from engine.offload.expert_compute import PromptKernels, SlotReader, expert_mlp

if TYPE_CHECKING:
    from engine.offload.cpu_experts import CpuExperts


class LayerRouting:
    """One MoE layer's routing in a forward step, brought to the host once and summarised."""

    def __init__(self, layer: int, top_k_index: torch.Tensor, num_experts: int) -> None:
        self.num_tokens, self.top_k = top_k_index.shape
        self.num_experts = num_experts
        self.flat = top_k_index.reshape(-1)
        picks = self.flat.tolist() if self.num_tokens == 1 else None
        self._flat_host: np.ndarray | None = None
        self._counts: np.ndarray | None = None
        self._sorted: tuple[torch.Tensor, list[int]] | None = None
        if picks is not None and len(set(picks)) == len(picks):  # a decode token: nothing to count
            self.picks: list[int] | None = picks
            self.needed = sorted(picks)
            self.step = RoutingStep.of_layer(layer, self.needed)
        else:
            self.picks = None
            counts = self.counts
            self.needed = np.flatnonzero(counts).tolist()
            last = self.flat_host[-self.top_k:].tolist() if self.num_tokens > 1 else None
            self.step = RoutingStep.of_layer(layer, self.needed, counts[self.needed], self.num_tokens, last)

    @property
    def flat_host(self) -> np.ndarray:
        if self._flat_host is None:
            self._flat_host = np.asarray(self.picks) if self.picks is not None else self.flat.cpu().numpy()
        return self._flat_host

    @property
    def counts(self) -> np.ndarray:
        """[experts] rows routed to each expert."""
        if self._counts is None:
            self._counts = np.bincount(self.flat_host, minlength=self.num_experts)
        return self._counts

    def rows_of(self, expert: int) -> torch.Tensor:
        """The flat (token, pick) rows routed to `expert`."""
        order, bounds = self.by_expert()
        return order[bounds[expert] : bounds[expert + 1]]

    def by_expert(self) -> tuple[torch.Tensor, list[int]]:
        """The flat rows sorted by expert and where each expert's rows start in that order ([experts + 1]).

        The sort is transformers' own (`torch.sort`, not stable): within an expert, a row's place in
        its matmul decides which of the GEMM's row kernels computes it, and on some CPUs (AVX2 builds
        of oneDNN) those sum in different orders, so the rows go in the order the stock model gives."""
        if self._sorted is None:
            self._sorted = (torch.sort(self.flat)[1], np.concatenate(([0], np.cumsum(self.counts))).tolist())
        return self._sorted

    def by_expert_host(self) -> np.ndarray:
        """`by_expert`'s order as a host array, sorted on the host where the routing is on a GPU (no
        second sync)."""
        if self.flat.device.type == "cpu":
            return self.by_expert()[0].numpy()
        return torch.sort(torch.from_numpy(self.flat_host))[1].numpy()


class LayerRows:
    """One layer's rows in one forward step, their expert outputs and the layer's output.

    The rows are gathered once in expert order (on the first expert computed one by one or in the
    prompt path's one call, not by the grouped matmul, which writes `out` itself), each expert's a
    contiguous slice, and their weighted outputs go back in one scatter at the end (`result`): the
    same values as gathering and scattering each expert's rows (advanced indexing per expert cost
    more than a small expert's matmuls)."""

    def __init__(self, hidden_states: torch.Tensor, routing: LayerRouting, weights: torch.Tensor,
                 out_dtype: torch.dtype, reader: SlotReader, prompt: PromptKernels | None, packed: bool) -> None:
        self.hidden_states, self.routing, self.weights, self.out_dtype = hidden_states, routing, weights, out_dtype
        self.reader, self.prompt, self.packed = reader, prompt, packed
        # [flat rows, hidden]: weighted outputs in flat (token, pick) order, written by the grouped
        # matmul and the CPU experts, and by the scatter of the sorted outputs (`result`)
        self.out = torch.empty((routing.flat.numel(), hidden_states.shape[-1]), dtype=out_dtype,
                               device=hidden_states.device)
        self._sorted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, weights, outputs
        self.computed: list[slice] = []  # parts of the sorted order whose outputs are in
        self.combined: torch.Tensor | None = None  # the layer's output, where the prompt path's combine made it

    def sorted_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows, their routing weights and room for their outputs, in expert order (gathered on
        first use)."""
        if self._sorted is None:
            order = self.routing.by_expert()[0]  # made once per layer step
            self._sorted = (self.hidden_states[order // self.routing.top_k], self.weights[order].unsqueeze(-1),
                            torch.empty_like(self.out))
        return self._sorted

    def compute_one(self, module: torch.nn.Module, expert: int, slot: dict[str, torch.Tensor]) -> None:
        """`expert`'s rows through its `slot`'s weights, weighted, into the sorted outputs."""
        rows, routing_weights, outputs = self.sorted_rows()
        bounds = self.routing.by_expert()[1]  # where each expert's rows start in the sorted order
        part = slice(bounds[expert], bounds[expert + 1])
        product = self.prompt.product if self.prompt is not None else None
        y = expert_mlp(module, rows[part], self.reader.plain(slot, product), self.packed)
        torch.mul(y, routing_weights[part], out=outputs[part])
        self.computed.append(part)

    def compute_in_one_call(self, module: torch.nn.Module, experts: list[int],
                            slots: list[dict[str, torch.Tensor]]) -> bool:
        """`experts` (in `slots`) on the prompt path's layer kernel; False where it does not compute
        this module."""
        rows, routing_weights, _ = self.sorted_rows()
        order, bounds = self.routing.by_expert()
        start = [bounds[e] for e in experts]
        count = [bounds[e + 1] - bounds[e] for e in experts]
        y = self.prompt.layer(module, rows, start, count, slots, self.reader)
        if y is None:
            return False
        every_row = sum(count) == rows.shape[0]
        if every_row and self._combines(y):  # nothing else to add: weighted, scattered and summed in one call
            self.combined = self.prompt.combine(y, routing_weights.view(-1), order, self.routing.top_k)
        else:
            self._weigh(y, [slice(s, s + c) for s, c in zip(start, count, strict=True) if c], every_row)
        return True

    def _combines(self, y: torch.Tensor) -> bool:
        """Whether the prompt path's combine takes the one call's outputs `y` (all rows) as they are."""
        routing_weights = self.sorted_rows()[1]
        return self.prompt.combine is not None and y.device.type == "cpu" \
            and routing_weights.dtype in (torch.float32, torch.bfloat16) \
            and y.dtype == self.hidden_states.dtype == torch.bfloat16

    def _weigh(self, y: torch.Tensor, parts: list[slice], every_row: bool) -> None:
        """The one call's outputs `y` (in sorted order) times their routing weights into the sorted outputs."""
        _, routing_weights, outputs = self.sorted_rows()
        if every_row:  # one weighting
            torch.mul(y, routing_weights, out=outputs)
        else:
            for part in parts:
                torch.mul(y[part], routing_weights[part], out=outputs[part])
        self.computed.extend(parts)

    def compute_on_cpu(self, cpu_experts: CpuExperts, layer: int, expert: int, module: torch.nn.Module) -> None:
        """`expert`'s rows on the CPU (Fiddler), weighted, straight into `out`."""
        rows = self.routing.rows_of(expert)
        y = cpu_experts.run(layer, expert, module, self.hidden_states[rows // self.routing.top_k])
        self.out[rows] = y.to(self.out_dtype) * self.weights[rows].unsqueeze(-1)

    def result(self) -> torch.Tensor:
        """The layer's output [tokens, hidden]: the sorted outputs scattered back, summed per token."""
        if self.combined is not None:  # the one call computed every row, so no other expert ran
            return self.combined
        if self.computed:
            order, outputs = self.routing.by_expert()[0], self.sorted_rows()[2]
            if sum(part.stop - part.start for part in self.computed) == self.out.shape[0]:  # every row: one scatter
                self.out.index_copy_(0, order, outputs)
            else:
                at = torch.cat([order[part] for part in self.computed])
                self.out.index_copy_(0, at, torch.cat([outputs[part] for part in self.computed]))
        return self.out.view(self.routing.num_tokens, self.routing.top_k, -1).sum(dim=1).to(self.hidden_states.dtype)
