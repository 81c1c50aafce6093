"""The expert cache: a budgeted pool of slots in compute memory, filled from the store.

Each MoE layer owns a contiguous pool `[slots, slot_bytes]` (uint8) on the compute device with
typed views per expert parameter, so an expert's weights are read in place — never copied out of
its slot. The pool is resized between tokens when the budget changes (no reload).

Per layer and forward, `run_layer`:
1. summarises the routing on the host (`LayerRouting`: the one sync per layer);
2. records it (`record`): the directory splits the needed experts into ready, in flight (a
   prefetch still loading) and missing and tells the policy; counters and miss curves count it.
   A whole decode token computed in one native call is recorded through the same `record`;
3. plans the loads (`_plan_loads`): exact loads for the misses (they pre-empt speculative loads,
   `engine.offload.loads`), needed in-flight prefetches promoted, the policy's prefetches;
4. computes (`_compute`) in the order resident -> in flight -> not started, each as soon as its
   bytes are in (reordered execution, Mixtral-offloading; ProMoE's execution order), on the
   layer's rows gathered once in expert order (`LayerRows`). A decode token whose picks are all
   resident runs on the one-token experts kernel it was handed.
When a layer needs more experts at once than it has slots (long prefills), the misses stream
through the layer's slots in waves: the slots double as the staging buffer, so memory never
exceeds the budget.

Exactness rests on three rules: an expert is computed only after its load finished; a slot that
is loading or holds an expert of the running layer is never given away (`CacheDirectory`); and on
CUDA a copy into a slot first waits for every kernel queued before the slot was reassigned (a
fence event), so no queued computation reads half-new bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.accounting.counters import EngineCounters
from engine.accounting.directory import CacheDirectory, Lookup, NoFreeSlotError
from engine.accounting.policies.base import CachePolicy
from engine.accounting.routing import RoutingStep
from engine.formats.dequantize import Dequantizer, reference_dequantizer
from engine.model.layout import ExpertParam, MoELayout, aligned
from engine.offload.expert_compute import (
    OneTokenExperts,
    PromptKernels,
    SlotReader,
    grouped_available,
    grouped_expert_mlp,
    torch_one_token,
)
from engine.offload.layer_rows import LayerRouting, LayerRows
from engine.offload.loads import JobState, LoadJob, LoadQueue
from engine.offload.packed_linear import pack
from engine.offload.store import ExpertStore
from engine.system import huge_pages

PREDICTION_WINDOW_TRACED = 3  # layers ahead recorded in traces (so promoe:k<=3 can be replayed)
# Quantized slots run grouped from a dequantized copy of this many bytes at most (one expert at least).
GROUPED_SCRATCH_BYTES = 128 << 20


@dataclass
class LoadPlan:
    """What one layer's step computes where, in order."""

    ready: list[int]  # resident with their bytes in: first
    on_cpu: list[int]  # missing, computed on the CPU instead of loaded (Fiddler)
    inflight: list[LoadJob]  # prefetches still loading, now needed
    loads: list[LoadJob]  # exact loads started for this step
    waves: list[int]  # misses beyond the free slots, streamed through them afterwards
    held: set[int] = field(default_factory=set)  # resident experts the waves must not take (wave_order)


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
        *,
        predictor=None,  # engine.decode.routers.RouterTaps: routing guesses for policies with lookahead
        packed_params: frozenset[str] = frozenset(),  # kept packed for oneDNN per slot (engine.offload.packed_linear)
    ) -> None:
        self.layout, self.store, self.device, self.counters = layout, store, device, counters
        self.gather = None  # engine.decode.layer_gather.LayerGather, while replies' forwards run gathered
        policy.reset(layout.num_layers, layout.num_experts, layout.top_k)
        self.directory = CacheDirectory(slots_per_layer, policy)
        # Packed matrices (CPU) live as one opaque tensor per slot; the byte pool holds the rest.
        self.packed_params = packed_params if device.type == "cpu" else frozenset()
        self._packed = bool(self.packed_params)
        self._pool_params, self._pool_slot_bytes = self._pool_layout()
        self.pools = [self._alloc(n) for n in slots_per_layer]
        self.views = [self._typed_views(pool, layer) for layer, pool in enumerate(self.pools)]
        self.slot_views = [self._per_slot(views, n) for views, n in zip(self.views, slots_per_layer, strict=True)]
        self.predictor = predictor
        self.tracer = None  # engine.traces.trace.TraceWriter while a trace is being recorded
        self.cpu_experts = None  # engine.offload.cpu_experts.CpuExperts when Fiddler's CPU execution is on
        self._cuda = device.type == "cuda"
        self._staging = threading.local()  # one slot-sized buffer per load thread (pinned on CUDA)
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device)
        self._jobs: dict[tuple[int, int], LoadJob] = {}  # pending loads by (layer, expert)
        self._queue = LoadQueue(self._move_chunk, workers=load_threads)
        self.grouped = self._grouped_pays()  # a step's resident experts as grouped matmuls
        # A decode token's resident experts: on a GPU each kernel launch costs more than a small
        # expert's matmul, so they run grouped (a few launches a layer, not a few per expert); on a
        # CPU one-row matmuls straight from the slots skip the grouped path's gathers and scatters.
        self.decode_grouped = self.grouped and self._cuda
        self._dequantizer: Dequantizer = reference_dequantizer
        self.reader = SlotReader(self._pool_params, layout.compute_dtype, packed=self._packed)
        self._layer_readers = self._readers_by_layer()
        self._one_token: OneTokenExperts = torch_one_token  # a decode path may bring its own (`experts_kernel`)
        self._prompt: PromptKernels | None = None  # a prompt path may bring its own (`prompt_kernels`)

    def _grouped_pays(self) -> bool:
        """Whether a step's resident experts run as one grouped matmul per weight, read in place from the
        pool. Not for packed matrices (they are not in the pool: each expert then runs on its own), nor
        for quantized slots on a CPU: they are dequantized together into a bounded scratch first
        (SlotReader.grouped), which pays on a GPU, where each expansion is a few dozen launches, but on
        a CPU torch's grouped matmul runs slower than oneDNN's on one expanded expert at a time."""
        return bool(self.pools) and grouped_available(self.pools[0]) and not self._packed \
            and (self._cuda or not self.layout.quantized)

    def use_dequantizer(self, dequantizer: Dequantizer) -> None:
        """Quantized slots are expanded with `dequantizer` from now on (one giving the reference's
        values: what runs on them does not change, only how fast they are expanded)."""
        self._dequantizer = self.reader.dequantizer = dequantizer
        for reader in self._layer_readers.values():
            reader.dequantizer = dequantizer

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

    def _pool_layout(self) -> tuple[list[ExpertParam], int]:
        """The params the byte pool holds (all but the packed ones) at their offsets in a pool slot."""
        if not self._packed:
            return list(self.layout.params), self.layout.slot_bytes
        params, offset = [], 0
        for p in self.layout.params:
            if p.name not in self.packed_params:
                params.append(ExpertParam(p.name, p.shape, p.dtype, offset, p.nbytes, p.fmt, p.transposed))
                offset += aligned(p.nbytes)
        return params, offset

    def _alloc(self, slots: int, slot_bytes: int | None = None) -> torch.Tensor:
        shape = (slots, slot_bytes or self._pool_slot_bytes)
        if self.device.type == "cpu":
            return huge_pages.empty(shape, torch.uint8)  # decode streams these: fewer TLB misses
        return torch.empty(shape, dtype=torch.uint8, device=self.device)

    def _typed_views(self, pool: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        n = pool.shape[0]
        params = self._pool_params if self._packed else self.layout.params_at(layer)  # packed: never per layer
        return {p.name: pool[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(n, *p.slot_shape) for p in params}

    def _readers_by_layer(self) -> dict[int, SlotReader]:
        """A reader for each layer whose experts are stored in other formats than the widest."""
        return {layer: self.reader.with_params(params) for layer, params in self.layout.layer_params.items()}

    @property
    def quantized_slots(self) -> bool:
        """Some layer's experts are stored in a block format."""
        return bool(self.reader.quantized) or any(r.quantized for r in self._layer_readers.values())

    def reader_at(self, layer: int) -> SlotReader:
        """How MoE layer `layer`'s slots are read (its own block formats)."""
        return self._layer_readers.get(layer, self.reader)

    @staticmethod
    def _per_slot(views: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
        """Each slot's weights as views, made once: indexing the pool per expert and token costs
        more than the decode step's bookkeeping budget. Packed matrices join a slot's dict when
        they are loaded."""
        return [{name: view[slot] for name, view in views.items()} for slot in range(count)]

    def resident_matrix(self) -> np.ndarray:
        resident = np.zeros((self.layout.num_layers, self.layout.num_experts), dtype=bool)
        for layer, slots in enumerate(self.directory.slot_of):
            resident[layer, list(slots)] = True
        return resident

    def set_policy(self, policy: CachePolicy) -> None:
        """Switch policy between tokens; residents stay, loads in flight finish."""
        policy.reset(self.layout.num_layers, self.layout.num_experts, self.layout.top_k)
        self.directory.set_policy(policy)

    def resize(self, slots_per_layer: Sequence[int]) -> None:
        """Grow or shrink each layer's pool; experts that stay keep their bytes (no reload)."""
        self.settle()
        if self._packed and any(n < self.layout.num_experts for n in slots_per_layer):
            self.unpack()  # below `all`, experts load on demand: packing would sit on every miss's path
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
            old_slots = self.slot_views[layer]
            self.pools[layer] = new
            self.views[layer] = self._typed_views(new, layer)
            self.slot_views[layer] = self._per_slot(self.views[layer], count)
            for source, target in move.items():  # packed matrices move by reference
                for name in self.packed_params & old_slots[source].keys():
                    self.slot_views[layer][target][name] = old_slots[source][name]

    def unpack(self) -> None:
        """Back to plain weights in full-layout pools (exact either way), for good."""
        if not self._packed:
            return
        self.settle()
        full = self.layout.params
        for layer, old in enumerate(self.pools):
            count = old.shape[0]
            pool = self._alloc(count, self.layout.slot_bytes)
            for slot, weights in enumerate(self.slot_views[layer]):
                for p in full:
                    if p.name in weights:
                        plain = weights[p.name].to_dense() if p.name in self.packed_params else weights[p.name]
                        pool[slot, p.offset : p.offset + p.nbytes].view(p.dtype).copy_(plain.reshape(-1))
            self.pools[layer] = pool
        self.packed_params, self._packed = frozenset(), False
        self._pool_params, self._pool_slot_bytes = list(full), self.layout.slot_bytes
        self.reader = SlotReader(self._pool_params, self.layout.compute_dtype, dequantizer=self._dequantizer)
        self._layer_readers = self._readers_by_layer()
        self.views = [self._typed_views(pool, layer) for layer, pool in enumerate(self.pools)]
        self.slot_views = [self._per_slot(views, pool.shape[0]) for views, pool in zip(self.views, self.pools, strict=True)]
        self.grouped = self._grouped_pays()

    def warm(self, order: Sequence[Sequence[int]] | None = None) -> int:
        """Fill every free slot (at load, so the first tokens do not all miss); returns bytes read."""
        jobs = []
        for layer, free in enumerate(self._free_counts()):
            preferred = (order[layer] if order else None) or self.policy.preferred(layer) or range(self.layout.num_experts)
            wanted = [e for e in preferred if e not in self.directory.slot_of[layer]][:free]
            jobs += [self._start_load(layer, e, set()) for e in wanted]
        nbytes = 0
        for job in jobs:
            job.wait()
            nbytes += job.nbytes
            self._collect(job, count=False)
        return nbytes

    def _free_counts(self) -> list[int]:
        return [len(row) - len(slots) for row, slots in zip(self.directory.expert_in, self.directory.slot_of, strict=True)]

    # ----- loading -----
    @torch.inference_mode()  # pools made by a resize during generation are inference tensors
    def _move_chunk(self, job: LoadJob, chunk: int) -> int:
        """One weight matrix of `job`'s expert into its slot (runs on a load thread)."""
        p = self.layout.params_at(job.layer)[chunk]
        target = self.pools[job.layer][job.slot]  # pools are replaced only after `settle`
        if not self._cuda and not self._packed:
            return self.store.fill_param(job.layer, job.expert, p.name, target)
        if not self._cuda:  # via a slot-shaped buffer: packed, or copied to the param's place in the pool
            staging = self._staging_buffer(pin=False)
            moved = self.store.fill_param(job.layer, job.expert, p.name, staging)
            plain = staging[p.offset : p.offset + p.nbytes]
            if p.name in self.packed_params:
                self.slot_views[job.layer][job.slot][p.name] = pack(plain.view(p.dtype).view(p.shape))
            else:
                place = next(q for q in self._pool_params if q.name == p.name)
                target[place.offset : place.offset + p.nbytes].copy_(plain)
            return moved
        host = self.store.host_view(job.layer, job.expert)
        moved = p.nbytes
        if host is None:
            host = self._staging_buffer(pin=True)
            moved = self.store.fill_param(job.layer, job.expert, p.name, host)
        with torch.cuda.stream(self._copy_stream):
            if job.fence is not None:
                self._copy_stream.wait_event(job.fence)
            target[p.offset : p.offset + p.nbytes].copy_(host[p.offset : p.offset + p.nbytes], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()  # the staging buffer is reused by the next chunk
        return moved

    def _staging_buffer(self, *, pin: bool) -> torch.Tensor:
        buffer = getattr(self._staging, "buffer", None)
        if buffer is None:
            buffer = self._staging.buffer = torch.empty(self.layout.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        return buffer

    def _fence(self):
        if not self._cuda:
            return None
        fence = torch.cuda.Event()
        fence.record()  # everything queued so far on the compute stream, e.g. reads of the evicted expert
        return fence

    def _start_load(self, layer: int, expert: int, protected: set[int], *, speculative: bool = False) -> LoadJob:
        while True:
            try:
                slot, _ = self.directory.assign(layer, expert, protected, pending=True)
                break
            except NoFreeSlotError:
                self._make_room(layer, protected)
        return self._submit(layer, expert, slot, speculative=speculative)

    def _submit(self, layer: int, expert: int, slot: int, *, speculative: bool) -> LoadJob:
        job = LoadJob(layer, expert, slot, len(self.layout.params), speculative=speculative, fence=self._fence())
        self._jobs[(layer, expert)] = job
        return self._queue.submit(job)

    def _make_room(self, layer: int, protected: set[int]) -> None:
        """Every free slot of `layer` is taken by prefetches still loading: cancel those (between chunks)."""
        blocking = [self._jobs[(layer, e)] for e in self.directory.pending[layer] if e not in protected]
        if not blocking:
            raise RuntimeError(f"layer {layer}: no slot can be freed for a needed expert")
        for job in blocking:
            self._queue.cancel(job)
        for job in blocking:
            self._wait(job)

    def _wait(self, job: LoadJob) -> None:
        if not job.finished:
            start = time.perf_counter()
            job._finished.wait()
            self.counters.record_stall(time.perf_counter() - start)
        self._collect(job)

    def _collect(self, job: LoadJob, *, count: bool = True) -> None:
        """Account for a finished or cancelled job, once, on the compute thread."""
        if job.collected:
            return
        job.collected = True
        self._jobs.pop((job.layer, job.expert), None)
        if job.state == JobState.DONE:
            self.directory.complete(job.layer, job.expert)
        else:
            self.directory.abort(job.layer, job.expert)
        if count:
            self.counters.record_load(job.nbytes, prefetch=job.prefetch)
        if job.error is not None:
            raise job.error

    def _collect_finished(self) -> None:
        for job in self._queue.take_finished():
            self._collect(job)

    def settle(self) -> None:
        """Stop speculative loads and wait for every load (before the pools change)."""
        for job in list(self._jobs.values()):
            self._queue.cancel(job)
        for job in list(self._jobs.values()):
            self._wait(job)
        self._collect_finished()

    def _prefetch(self, layer: int, protected: set[int]) -> None:
        wanted = [(lyr, e) for lyr, e in self.policy.prefetch(layer) if lyr != layer]
        if not wanted:
            return
        for lyr, expert, slot in self.directory.place_prefetches(wanted, {layer: protected}):
            self._submit(lyr, expert, slot, speculative=True)

    # ----- compute -----
    def whole_token_problem(self) -> str | None:
        """Why a decode token cannot run whole and be recorded afterwards (`record` with every layer
        at once); None when every expert of every layer sits ready in its slot and nothing needs
        to see a layer's routing while it runs."""
        if self.tracer is not None:
            return "a routing trace is being recorded, layer by layer"
        if self.policy.lookahead:
            return "the policy looks ahead at each layer's routing"
        if self._jobs or self.directory.any_pending():
            return "expert loads are in flight"
        if any(len(slots) < self.layout.num_experts for slots in self.directory.slot_of):
            return "not every expert is resident (the budget is below all)"
        return None

    def record(self, step: RoutingStep) -> list[Lookup]:
        """Record a step's routing everywhere it is counted (directory and policy, counters, miss
        curves); returns where each row's experts are. One layer of a forward step, or a whole
        decode token computed in one call: the same bookkeeping."""
        found = self.directory.lookup(step)
        hits = np.fromiter((len(f.ready) + len(f.inflight) for f in found), dtype=np.int64, count=len(found))
        misses = np.fromiter((len(f.missing) for f in found), dtype=np.int64, count=len(found))
        self.counters.record(step, hits, misses)
        return found

    def record_resident(self, step: RoutingStep) -> None:
        """`record` for a step whose every expert sits ready in its slot (the whole-token step's
        condition, `whole_token_problem`): the same counts, without splitting each row's experts by
        where they are. Run between tokens, after the weights' streams have evicted this code and
        its data from the CPU caches, every call here costs several times its warm time."""
        if any(self.directory.unused_prefetch):  # a prefetch's first use is counted by the split
            self.record(step)
            return
        self.directory.policy.on_access(step)
        hits = np.full(len(step.layers), step.experts.shape[1], dtype=np.int64)
        self.counters.record(step, hits, np.zeros_like(hits))

    @contextmanager
    def experts_kernel(self, kernel: OneTokenExperts) -> Iterator[None]:
        """Within the block, a decode token whose picks are all resident runs on `kernel`."""
        previous, self._one_token = self._one_token, kernel
        try:
            yield
        finally:
            self._one_token = previous

    @contextmanager
    def prompt_kernels(self, kernels: PromptKernels) -> Iterator[None]:
        """Within the block, many-row steps run a layer's resident experts with `kernels.layer` and
        multiply the others' quantized slots with `kernels.product` instead of expanding each expert
        into a scratch for torch's kernels."""
        previous, self._prompt = self._prompt, kernels
        try:
            yield
        finally:
            self._prompt = previous

    def run_layer(
        self,
        layer: int,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """One MoE layer of a forward step: summarise the routing, record it, plan the loads, compute.
        Inside a forward that runs gathered with others (engine.decode.layer_gather), it waits for theirs
        and the layer runs once for all their rows."""
        if self.gather is not None and self.gather.owns_current():
            return self.gather.park(layer, module, hidden_states, top_k_index, top_k_weights)
        routing, found, weights, out_dtype = self._begin_layer(layer, hidden_states, top_k_index, top_k_weights)
        one_token = routing.picks is not None and not self.decode_grouped
        if one_token and len(found.ready) == routing.top_k:  # a decode token, every pick resident
            if self.policy.prefetches:
                self._prefetch(layer, set(routing.needed))
            return self._one_token_step(layer, module, hidden_states, routing, weights, out_dtype)
        plan = self._plan_loads(layer, found, routing)
        if one_token and not plan.on_cpu and not plan.waves:
            # A decode token with misses waits for them and then runs as if all were resident: its
            # experts' compute is small beside a load, and the token gets the same kernel (and the
            # same bits) at every budget.
            for job in plan.inflight + plan.loads:
                self._wait(job)
            return self._one_token_step(layer, module, hidden_states, routing, weights, out_dtype)
        return self._compute(layer, module, hidden_states, routing, plan, weights, out_dtype)

    def _begin_layer(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> tuple[LayerRouting, Lookup, torch.Tensor, torch.dtype]:
        """A layer's routing summarised (the one host sync), recorded and shown to the policy: (routing,
        what was found resident, the flat weights, the output dtype)."""
        routing = LayerRouting(layer, top_k_index, self.layout.num_experts)
        if self._jobs:
            self._collect_finished()
        found = self.record(routing.step)[0]
        if self.policy.lookahead or self.tracer is not None:
            self._observe_routing(layer, hidden_states, top_k_index, top_k_weights)
        weights = top_k_weights.reshape(-1)
        return routing, found, weights, torch.promote_types(self.layout.compute_dtype, weights.dtype)

    def run_rows_apart(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer for a few rows of different replies (engine.decode.layer_gather): their experts
        recorded and loaded together (each once, however many rows picked it), then each row on the
        one-token kernel, as it runs alone. Where their misses do not fit beside the resident experts
        at once, or on a GPU's grouped decode, the many-rows computation runs instead."""
        routing, found, weights, out_dtype = self._begin_layer(layer, hidden_states, top_k_index, top_k_weights)
        plan = self._plan_loads(layer, found, routing)
        if self.decode_grouped or plan.on_cpu or plan.waves:
            return self._compute(layer, module, hidden_states, routing, plan, weights, out_dtype)
        for job in plan.inflight + plan.loads:
            self._wait(job)
        if self.policy.prefetches:
            self._prefetch(layer, set(routing.needed))
        rows = [self._one_token_step(layer, module, hidden_states[r:r + 1],
                                     LayerRouting(layer, top_k_index[r:r + 1], self.layout.num_experts),
                                     top_k_weights[r].reshape(-1), out_dtype)
                for r in range(hidden_states.shape[0])]
        return torch.cat(rows)

    def _one_token_step(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor,
                        routing: LayerRouting, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        slot_of, slots = self.directory.slot_of[layer], self.slot_views[layer]
        chosen = [slots[slot_of[e]] for e in routing.picks]
        return self._one_token(module, hidden_states, chosen, weights, out_dtype, self.reader_at(layer))

    def _plan_loads(self, layer: int, found: Lookup, routing: LayerRouting) -> LoadPlan:
        """Start what this step needs: exact loads for the misses that fit beside the resident
        experts (the rest stream through the slots in waves), in-flight prefetches promoted, some
        misses left to the CPU (Fiddler), and the policy's prefetches for other layers."""
        protected = set(routing.needed)
        missing = found.missing
        on_cpu: list[int] = []
        if self.cpu_experts is not None and missing:
            on_cpu = [e for e in missing if self.cpu_experts.prefers_cpu(int(routing.counts[e]))]
            missing = [e for e in missing if e not in on_cpu]
        room = len(self.directory.expert_in[layer]) - len(found.ready) - len(found.inflight)
        held: set[int] = set()
        if len(missing) > room:  # waves: stream the least wanted first, so the ones the policy keeps stay
            missing, held = self.directory.wave_order(layer, routing.needed, missing)
        for expert in found.inflight:  # needed now: exact priority
            self._queue.promote(self._jobs[(layer, expert)])
        loads = [self._start_load(layer, e, protected) for e in missing[:room]]
        if self.policy.prefetches:
            self._prefetch(layer, protected)
        return LoadPlan(found.ready, on_cpu, [self._jobs[(layer, e)] for e in found.inflight], loads, missing[room:],
                        held)

    def _compute(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor, routing: LayerRouting,
                 plan: LoadPlan, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Resident experts first, then the ones on the CPU, in flight, just started, and in waves:
        each as soon as its bytes are in (reordered execution)."""
        rows = LayerRows(hidden_states, routing, weights, out_dtype, self.reader_at(layer), self._prompt, self._packed)
        self._compute_resident(layer, module, rows, plan.ready)  # while the misses load
        for expert in plan.on_cpu:
            rows.compute_on_cpu(self.cpu_experts, layer, expert, module)
        self._compute_loading(layer, module, rows, plan.inflight + plan.loads)  # on their way, then started now
        self._compute_waves(layer, module, rows, plan)
        return rows.result()

    def _slot(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The views of the slot `expert` sits in now."""
        return self.slot_views[layer][self.directory.slot_of[layer][expert]]

    def _compute_resident(self, layer: int, module: torch.nn.Module, rows: LayerRows, experts: list[int]) -> None:
        """The resident `experts`: on the prompt kernel a fast prompt brought, else grouped, else one by one."""
        if self._prompt is None and self.grouped and len(experts) > 1:
            self._compute_grouped(layer, module, rows.hidden_states, rows.routing, experts, rows.weights, rows.out)
            return
        if self._prompt is not None and experts \
                and rows.compute_in_one_call(module, experts, [self._slot(layer, e) for e in experts]):
            return
        for expert in experts:
            rows.compute_one(module, expert, self._slot(layer, expert))

    def _compute_loading(self, layer: int, module: torch.nn.Module, rows: LayerRows, jobs: list[LoadJob]) -> None:
        """The experts of `jobs`, each as soon as its load finished."""
        if rows.routing.picks is not None and self.decode_grouped and len(jobs) > 1:
            # A decode token's misses: their matmuls are small beside a load, their launches are not.
            for job in jobs:
                self._wait(job)
            experts = [job.expert for job in jobs]
            self._compute_grouped(layer, module, rows.hidden_states, rows.routing, experts, rows.weights, rows.out)
            return
        for job in jobs:
            self._wait(job)
            rows.compute_one(module, job.expert, self._slot(layer, job.expert))

    def _compute_waves(self, layer: int, module: torch.nn.Module, rows: LayerRows, plan: LoadPlan) -> None:
        """More experts than slots: stream the remainder through the slots the step does not hold, in waves."""
        rest, size = plan.waves, len(self.directory.expert_in[layer]) - len(plan.held)
        while rest:
            wave, rest = rest[:size], rest[size:]
            for job in [self._start_load(layer, e, set(wave) | plan.held) for e in wave]:  # one by one, never grouped
                self._wait(job)
                rows.compute_one(module, job.expert, self._slot(layer, job.expert))

    def _compute_grouped(self, layer: int, module: torch.nn.Module, hidden: torch.Tensor, routing: LayerRouting,
                         experts: list[int], weights: torch.Tensor, out: torch.Tensor) -> None:
        """All `experts` (resident) of this layer in two grouped matmuls: straight from the slot pool,
        or for quantized slots from their dequantized copies, as many experts at a time as fit in
        GROUPED_SCRATCH_BYTES (at least one)."""
        slot_of, reader = self.directory.slot_of[layer], self.reader_at(layer)
        if not reader.quantized:
            groups = np.full(self.layout.num_experts, -1, dtype=np.int64)
            groups[experts] = [slot_of[e] for e in experts]
            self._grouped_rows(module, hidden, routing, groups, len(self.directory.expert_in[layer]),
                               self.views[layer], weights, out)
            return
        per_chunk = max(1, GROUPED_SCRATCH_BYTES // reader.scratch_bytes)
        for start in range(0, len(experts), per_chunk):
            chunk = experts[start : start + per_chunk]
            slots = torch.tensor([slot_of[e] for e in chunk], device=self.pools[layer].device)
            groups = np.full(self.layout.num_experts, -1, dtype=np.int64)
            groups[chunk] = np.arange(len(chunk))
            self._grouped_rows(module, hidden, routing, groups, len(chunk), reader.grouped(self.views[layer], slots),
                               weights, out)

    @staticmethod
    def _grouped_rows(module: torch.nn.Module, hidden: torch.Tensor, routing: LayerRouting, group_of: np.ndarray,
                      groups: int, stacked: dict[str, torch.Tensor], weights: torch.Tensor, out: torch.Tensor) -> None:
        """The rows of the experts with a group (`group_of[expert] >= 0`) through `stacked`'s matrices
        ([groups, ...] each), weighted, into `out`."""
        # Rows by expert in transformers' order (`by_expert`), then the experts' groups in order.
        by_expert = routing.by_expert_host()
        row_group = group_of[routing.flat_host]
        rows_host = by_expert[row_group[by_expert] >= 0]
        rows_host = rows_host[np.argsort(row_group[rows_host], kind="stable")]
        groups_sorted = row_group[rows_host]
        per_group = np.bincount(groups_sorted, minlength=groups)
        device = hidden.device
        rows = torch.from_numpy(rows_host).to(device)
        offsets = torch.from_numpy(np.cumsum(per_group, dtype=np.int32)).to(device)
        row_groups = torch.from_numpy(groups_sorted).to(device) if module.has_bias else None
        y = grouped_expert_mlp(module, hidden[rows // routing.top_k], stacked, offsets, row_groups)
        out[rows] = y * weights[rows].unsqueeze(-1)

    def _observe_routing(self, layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        """Routing guesses for the policy (if it looks ahead) and the trace (if one is recorded)."""
        lookahead = self.policy.lookahead  # called only when the policy looks ahead or a trace is recorded
        window = max(lookahead, PREDICTION_WINDOW_TRACED if self.tracer is not None else 0)
        predictions = self.predictor.predict(layer, hidden, window) if window and self.predictor is not None else {}
        if lookahead:
            self.policy.on_prediction(layer, {t: p for t, p in predictions.items() if t - layer <= lookahead})
        if self.tracer is not None:
            self.tracer.record(layer, index, weights, predictions)

    def stats(self) -> dict[str, float]:
        """Prefetch outcomes and the policy's own figures, for telemetry's `extra`."""
        figures = self.policy.stats()
        if self.cpu_experts is not None:
            figures |= self.cpu_experts.stats()
        return figures

    def close(self) -> None:
        self._queue.close()
        self._collect_finished()
        self.store.close()
