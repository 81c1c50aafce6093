"""The peak resident memory of a run (a load and its replies), modelled by part from a size estimate.

peak = max(the load's peak, the replies' peak). While the load gathers the dense weights into 2 MiB
pages it holds them twice (the checkpoint's pages it read and the copy) before the experts fill their
slots; the replies' peak is the weights plus the engine's own memory by part:

- the runtime: the interpreter, torch, transformers and the engine's code, the code pages a first
  forward touches, a smallest model's code and structures (constant);
- bookkeeping that grows with the model: Python objects and heap per layer and per routed expert;
- the expert pools rounded up to whole 2 MiB pages, and below `all` the miss path: its kernels' code and
  the load threads' staging buffers, each the largest expert;
- the KV cache for the context used, one per sequence decoding at once (`parallel`), and the input
  embedding's rows those tokens read (an untied embedding stays in the checkpoint's mapping);
- a prompt's working set: hidden states and logits per token, at most the fit verdict's margin.

Each constant is one part of `python -m bench.overhead`'s table (bench/results/overhead-*.md) or of
`python -m bench.estimate_check`'s tiny checkpoints that differ in that count alone; the check against
measured peaks is bench/results/estimate-check-*.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.accounting.sizes import parse_budget
from engine.hub.estimate import SizeEstimate

KiB, MiB = 1024, 1024**2
HUGE_PAGE = 2 * MiB  # engine.system.huge_pages: a pool this large or more is mapped in 2 MiB pages
IMPORTS = 328 * MiB  # bench.overhead: "+ generation path imports"
LOAD_CODE = 37 * MiB  # code pages a load and its first forward add: libtorch, extensions, OpenMP, native kernels
# Python objects and glibc heap of the smallest model's load (4 layers of 8 experts): its modeling code,
# the runtime's structures, the tokenizer
MODEL_OBJECTS = 42 * MiB
MODEL_CODE = 57 * MiB  # bench.overhead: "+ model skeleton (meta)", held while the load gathers the dense weights
# tiny checkpoints that differ in one count: 190 KiB and 5.3 KB in the runs the figures were set from,
# 289 KiB and 7.6 KB in estimate-check-vm-2026-11-29 (each engine-own figure moves by a few MiB run to run)
PER_LAYER = 190 * KiB  # 4 and 32 layers, 8 experts each
PER_EXPERT = 5300  # bytes per routed expert: 8 and 256 experts per layer
MISS_CODE = 5 * MiB  # bench.overhead's libtorch code pages, budget 25 % less budget all
LOAD_THREADS = 2  # the cache's load threads, each with a slot-sized staging buffer (engine.offload)
FAULT_AROUND = 64 * KiB  # the kernel maps this much of a cached file around each page a read faults in
PROMPT_MARGIN = 256 * MiB  # engine.hub.fit.ACTIVATION_MARGIN: a long prompt's activations, at most


@dataclass(frozen=True)
class Footprint:
    """A run's peak resident memory by part, in bytes."""

    dense: int  # dense weights resident: all but an untied input embedding's unread rows
    experts: int  # the budget's slots, as the planner allocates them
    runtime: int  # the engine before any model: constant
    bookkeeping: int  # per layer and per expert, and the pools' rounding to 2 MiB pages
    scratch: int  # below `all`: the miss path's code and staging buffers
    kv_cache: int  # the context used, times the sequences decoding at once
    prompt: int  # a prompt's working set
    load_peak: int  # the load's own peak: the dense weights twice, before the experts load

    @property
    def engine(self) -> int:
        """The engine's own memory: everything but weights."""
        return self.runtime + self.bookkeeping + self.scratch + self.kv_cache + self.prompt

    @property
    def peak(self) -> int:
        return max(self.load_peak, self.dense + self.experts + self.engine)

    def parts(self) -> list[tuple[str, int]]:
        return [("dense weights", self.dense), ("experts (budget)", self.experts), ("engine runtime", self.runtime),
                ("bookkeeping", self.bookkeeping), ("miss scratch", self.scratch), ("KV cache", self.kv_cache),
                ("prompt working set", self.prompt)]


def budget_slots(est: SizeEstimate, budget: str | int) -> list[int]:
    """Slots per MoE layer the planner gives `budget` (text as --budget takes it, or bytes): whole
    slots, spread evenly, within [top-k, all] per layer."""
    layers, per_layer = max(est.num_moe_layers, 1), max(est.num_experts, 1)
    slot = max(est.bytes_per_expert, 1)
    asked = budget if isinstance(budget, int) else parse_budget(budget).resolve_bytes(est.all_expert_bytes, slot)
    total = min(max(asked // slot, est.top_k * layers), per_layer * layers)
    return [total // layers + (1 if i < total % layers else 0) for i in range(layers)]


def run_footprint(est: SizeEstimate, budget: str | int = "all", *, context_tokens: int, parallel: int = 1,
                  prompt_tokens: int | None = None) -> Footprint:
    """The peak of a run at `budget` with `context_tokens` of context used by each of `parallel`
    sequences (each its own KV cache); `prompt_tokens`: the longest prompt read at once (default: the
    context)."""
    tokens = max(context_tokens, 1) * max(parallel, 1)
    slots = budget_slots(est, budget) if est.num_moe_layers else []
    pools = [n * est.bytes_per_expert for n in slots]
    rounding = sum(-pool % HUGE_PAGE for pool in pools if pool >= HUGE_PAGE)
    experts_total = est.num_experts * est.num_moe_layers
    bookkeeping = PER_LAYER * est.num_layers + PER_EXPERT * experts_total + rounding
    below_all = sum(slots) < experts_total
    scratch = MISS_CODE + LOAD_THREADS * est.bytes_per_expert if below_all else 0
    gathered = est.dense_bytes - (est.embedding_bytes if est.embedding_by_rows else 0)
    rows = min(est.embedding_bytes, tokens * FAULT_AROUND) if est.embedding_by_rows else 0
    hidden, vocab = est.hidden_size, est.vocab_size
    prompt = min(PROMPT_MARGIN, (prompt_tokens or context_tokens) * (hidden + vocab) * 4)  # float32 activations
    return Footprint(
        dense=gathered + rows, experts=sum(pools), runtime=IMPORTS + LOAD_CODE + MODEL_OBJECTS,
        bookkeeping=bookkeeping, scratch=scratch, kv_cache=est.kv_bytes_per_token * tokens, prompt=prompt,
        load_peak=IMPORTS + MODEL_CODE + 2 * gathered + rows)


def engine_own_bytes(est: SizeEstimate, budget: str | int) -> int:
    """The engine's own memory at `budget` beside the weights, before the context's KV cache and a
    prompt's working set (the fit verdict counts those as working memory)."""
    fp = run_footprint(est, budget, context_tokens=1, prompt_tokens=0)
    return fp.runtime + fp.bookkeeping + fp.scratch
