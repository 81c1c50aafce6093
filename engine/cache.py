"""The expert cache: a budgeted pool of slots in compute memory, filled from the store.

Each MoE layer owns a contiguous pool `[slots, slot_bytes]` (uint8) on the compute device with
typed views per expert parameter, so an expert's weights are read in place — never copied out of
its slot. The pool is resized between tokens when the budget changes (no reload).

Per layer and forward, `run_layer` asks the directory which needed experts are resident, starts
loading the missing ones on a background thread, computes the resident experts while those loads
run (reordered execution, Mixtral-offloading), then each loaded expert as it arrives. When a layer
needs more experts at once than it has slots (long prefills), the misses stream through the
layer's slots in waves: the slots double as the staging buffer, so memory never exceeds the budget.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.cache_directory import CacheDirectory
from engine.counters import EngineCounters
from engine.expert_mlp import expert_mlp
from engine.layout import MoELayout
from engine.policies.base import CachePolicy
from engine.store import ExpertStore


class ExpertCache:
    def __init__(
        self,
        layout: MoELayout,
        store: ExpertStore,
        device: torch.device,
        policy: CachePolicy,
        slots_per_layer: Sequence[int],
        counters: EngineCounters,
        load_threads: int = 2,
    ) -> None:
        self.layout, self.store, self.device, self.counters = layout, store, device, counters
        policy.reset(layout.num_layers, layout.num_experts, layout.top_k)
        self.directory = CacheDirectory(slots_per_layer, policy)
        self.pools = [self._alloc(n) for n in slots_per_layer]
        self.views = [self._typed_views(pool) for pool in self.pools]
        self._loader = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="moescope-load")
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device)

    # ----- memory -----
    @property
    def policy(self) -> CachePolicy:
        return self.directory.policy

    @property
    def slots_per_layer(self) -> list[int]:
        return self.directory.slots_per_layer

    @property
    def budget_bytes(self) -> int:
        return sum(self.slots_per_layer) * self.layout.slot_bytes

    def _alloc(self, slots: int) -> torch.Tensor:
        return torch.empty((slots, self.layout.slot_bytes), dtype=torch.uint8, device=self.device)

    def _typed_views(self, pool: torch.Tensor) -> dict[str, torch.Tensor]:
        n = pool.shape[0]
        return {
            p.name: pool[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(n, *p.shape)
            for p in self.layout.params
        }

    def resident_matrix(self) -> np.ndarray:
        resident = np.zeros((self.layout.num_layers, self.layout.num_experts), dtype=bool)
        for layer, slots in enumerate(self.directory.slot_of):
            resident[layer, list(slots)] = True
        return resident

    def resize(self, slots_per_layer: Sequence[int]) -> None:
        """Grow or shrink each layer's pool; experts that stay keep their bytes (no reload)."""
        moves = self.directory.resize(slots_per_layer)
        for layer, (count, move) in enumerate(zip(slots_per_layer, moves, strict=True)):
            old = self.pools[layer]
            if old.shape[0] == count and all(a == b for a, b in move.items()):
                continue
            new = self._alloc(count)
            if move:
                src = torch.tensor(list(move.keys()), device=self.device)
                dst = torch.tensor(list(move.values()), device=self.device)
                new[dst] = old[src]
            self.pools[layer] = new
            self.views[layer] = self._typed_views(new)

    def warm(self, order: Sequence[Sequence[int]] | None = None) -> int:
        """Fill every free slot (at load, so the first tokens do not all miss); returns bytes read."""
        futures = []
        for layer, free in enumerate(self._free_counts()):
            preferred = order[layer] if order else range(self.layout.num_experts)
            wanted = [e for e in preferred if e not in self.directory.slot_of[layer]][:free]
            for expert in wanted:
                slot, _ = self.directory.assign(layer, expert, set())
                futures.append(self._loader.submit(self._load, layer, expert, slot))
        return sum(f.result() for f in futures)

    def _free_counts(self) -> list[int]:
        return [len(row) - len(slots) for row, slots in zip(self.directory.expert_in, self.directory.slot_of, strict=True)]

    # ----- loading -----
    def _load(self, layer: int, expert: int, slot: int) -> int:
        target = self.pools[layer][slot]
        if not self._cuda:
            return self.store.fill(layer, expert, target)
        host = self.store.host_view(layer, expert)
        if host is None:
            host = torch.empty(self.layout.slot_bytes, dtype=torch.uint8, pin_memory=True)
            self.store.fill(layer, expert, host)
        with torch.cuda.stream(self._copy_stream):
            target.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()
        return self.layout.slot_bytes

    def _start_load(self, layer: int, expert: int, protected: set[int]) -> tuple[int, Future]:
        slot, _ = self.directory.assign(layer, expert, protected)
        return slot, self._loader.submit(self._load, layer, expert, slot)

    def _wait(self, future: Future) -> None:
        start = time.perf_counter()
        nbytes = future.result()
        self.counters.record_stall(time.perf_counter() - start)
        self.counters.record_load(nbytes)

    # ----- compute -----
    def run_layer(
        self,
        layer: int,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        counts = torch.bincount(flat, minlength=self.layout.num_experts).cpu().numpy()
        needed = np.flatnonzero(counts).tolist()
        hits, misses = self.directory.split(layer, needed)
        self.counters.record_layer(layer, counts, len(hits), len(misses))

        order = torch.argsort(flat, stable=True)
        bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
        weights = top_k_weights.reshape(-1)
        out_dtype = torch.promote_types(self.layout.params[0].dtype, weights.dtype)
        out = torch.empty((flat.numel(), hidden_states.shape[-1]), dtype=out_dtype, device=hidden_states.device)
        views = self.views[layer]

        def compute(expert: int) -> None:
            slot = self.directory.slot_of[layer][expert]
            rows = order[bounds[expert] : bounds[expert + 1]]
            y = expert_mlp(module, hidden_states[rows // top_k], {k: v[slot] for k, v in views.items()})
            out[rows] = y * weights[rows].unsqueeze(-1)

        capacity = len(self.directory.expert_in[layer])
        first, rest = misses[: capacity - len(hits)], misses[capacity - len(hits) :]
        protected = set(hits) | set(first)
        loads = [(e, self._start_load(layer, e, protected)[1]) for e in first]
        for expert in hits:  # resident experts run while the misses load
            compute(expert)
        for expert, future in loads:
            self._wait(future)
            compute(expert)
        while rest:  # more experts than slots: stream the remainder through the slots in waves
            wave, rest = rest[:capacity], rest[capacity:]
            loads = [(e, self._start_load(layer, e, set(wave))[1]) for e in wave]
            for expert, future in loads:
                self._wait(future)
                compute(expert)
        return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self.store.close()
