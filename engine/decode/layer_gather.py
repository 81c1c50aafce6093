"""Several replies' decode forwards run together, their MoE layers gathered into one computation.

Each reply keeps its own forward (its own KV cache, positions and attention), run in a greenlet of its
own on this thread. At every MoE layer the expert cache parks the forward (`ExpertCache.run_layer`
asks `owns_current`) and hands its rows here; once every forward is parked at that layer, the layer
runs once for all their rows: each expert any of them picked is loaded once and multiplied by every
row that chose it (the cache's many-rows computation, as a prompt's). Then each forward resumes with
its own rows' output. The dense weights are still read once per reply.

Greenlets rather than threads: one thread, one forward running at a time, switched only at the MoE
layers, so torch's and the kernels' thread-local state and thread pools are the ones a single
forward sees. Each row of a gathered layer runs on the one-token kernel, as alone (the same bits),
unless the misses do not fit beside the resident experts: then the many-rows computation (a
prompt's) sums them its own way, the fast path's arithmetic on the same weights. `--exact` never
gathers (its paths do not `gather`). The per-layer native path runs this
(`NativeLayersPath.run_together`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from greenlet import GreenletExit, getcurrent, greenlet

from engine.accounting.routing import picks_and_distinct


@dataclass
class _Parked:
    """A forward waiting at an MoE layer, with its rows for it."""

    layer: int
    module: torch.nn.Module
    hidden_states: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor


class LayerGather:
    def __init__(self, cache) -> None:
        self.cache = cache
        self._members: set[greenlet] = set()
        self.picks: list[np.ndarray] = []  # after `run`: each forward's experts, [layers, top_k] (-1: no MoE layer)
        self.uses = self.distinct = 0  # expert picks and distinct experts of the last `run`, its layers summed
        cache.gather = self

    def owns_current(self) -> bool:
        """The caller runs inside one of the forwards being gathered."""
        return bool(self._members) and getcurrent() in self._members

    def park(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
        """From inside a gathered forward: wait until the layer has run for every forward; its rows' output."""
        return getcurrent().parent.switch(_Parked(layer, module, hidden_states, top_k_index, top_k_weights))

    def run(self, forwards: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Run the forwards together; their results (logits), in order. An exception in one ends them all
        and is raised here."""
        lets = [greenlet(forward) for forward in forwards]
        self._members = set(lets)
        self.uses = self.distinct = 0
        self.picks = [np.full((self.cache.layout.num_layers, self.cache.layout.top_k), -1, dtype=np.int16)
                      for _ in lets]
        results: list[torch.Tensor | None] = [None] * len(lets)
        parked: dict[int, _Parked] = {}
        try:
            for index, let in enumerate(lets):
                self._take(index, let.switch(), results, parked)
            while parked:
                layer = min(p.layer for p in parked.values())  # the same layer for all, in practice
                here = {i: p for i, p in parked.items() if p.layer == layer}
                outputs = self._run_layer(list(here.values()))
                self._keep_picks(here)
                for (index, _), output in zip(here.items(), outputs, strict=True):
                    del parked[index]
                    self._take(index, lets[index].switch(output), results, parked)
        except BaseException:
            for let in lets:
                if not let.dead:
                    let.throw(GreenletExit)
            raise
        finally:
            self._members = set()
        return results

    def _keep_picks(self, here: dict[int, _Parked]) -> None:
        """Each one-token forward's experts at this layer, in order of id (as the counters keep them for
        a forward alone)."""
        for index, parked in here.items():
            row = parked.top_k_index.reshape(-1)
            if row.numel() == self.picks[index].shape[1]:
                self.picks[index][parked.layer] = np.sort(row.cpu().numpy())

    @staticmethod
    def _take(index: int, value, results: list, parked: dict) -> None:
        if isinstance(value, _Parked):
            parked[index] = value
        else:
            results[index] = value

    def _run_layer(self, waiting: list[_Parked]) -> list[torch.Tensor]:
        """The layer once for every parked forward's rows; each one's share of the output."""
        first = waiting[0]
        rows = [p.hidden_states.shape[0] for p in waiting]
        picks = torch.cat([p.top_k_index for p in waiting])
        out = self.cache.run_rows_apart(first.layer, first.module, torch.cat([p.hidden_states for p in waiting]), picks,
                                        torch.cat([p.top_k_weights for p in waiting]))
        uses, distinct = picks_and_distinct(picks.reshape(1, -1).cpu().numpy())
        self.uses += uses
        self.distinct += distinct
        return list(out.split(rows))
