"""A loaded model ready to generate: weights, tokenizer, store, cache, counters."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil
import torch

from engine import experts_impl
from engine.cache import ExpertCache
from engine.counters import EngineCounters
from engine.errors import MoEScopeError
from engine.inspect_model import ModelInfo, describe
from engine.loader import ProgressFn, build_model, resolve_device
from engine.planner import BudgetPlan, plan_budget
from engine.policies import make_policy
from engine.sizes import BudgetSpec, parse_budget
from engine.store import DiskStore, ExpertStore, RamStore


@dataclass
class LoadOptions:
    model: str
    budget: str = "all"
    store: str = "auto"  # auto | disk | ram
    device: str = "auto"  # auto | cpu | cuda
    policy: str = "lru"
    dtype: str = "auto"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    warm: bool = True  # fill the cache at load so the first tokens do not all miss


class MoERuntime:
    def __init__(self, options: LoadOptions, progress: ProgressFn | None = None) -> None:
        from transformers import AutoTokenizer

        started = time.perf_counter()
        self.options = options
        self.device = resolve_device(options.device)
        loaded = build_model(
            options.model,
            device=self.device,
            dtype=options.dtype,
            allow_pickle=options.allow_pickle,
            trust_remote_code=options.trust_remote_code,
            progress=progress,
        )
        self.model, self.layout, self.files, self.dtype = loaded.model, loaded.layout, loaded.files, loaded.dtype
        self.tokenizer = None  # checkpoints without tokenizer files still run on token ids (--prompt-ids)
        if any((self.files.root / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            self.tokenizer = AutoTokenizer.from_pretrained(self.files.root, trust_remote_code=options.trust_remote_code)
        self.store = self._open_store(options.store, progress)
        self.counters = EngineCounters(self.layout.num_layers, self.layout.num_experts)
        self.plan = self._plan(parse_budget(options.budget))
        self.cache = ExpertCache(
            self.layout, self.store, self.device, make_policy(options.policy), self.plan.slots_per_layer, self.counters
        )
        for layer, module_path in enumerate(self.layout.module_paths):
            setattr(self.model.get_submodule(module_path), experts_impl.RUNTIME_ATTR, (self.cache, layer))
        self.warm_bytes = self.cache.warm() if options.warm else 0
        self.load_seconds = time.perf_counter() - started

    # ----- setup -----
    def _open_store(self, kind: str, progress: ProgressFn | None) -> ExpertStore:
        if kind == "auto":
            # RAM only pays off when the experts can be copied to a GPU; on a CPU the cache is the RAM.
            fits = self.layout.all_expert_bytes < 0.6 * psutil.virtual_memory().available
            kind = "ram" if self.device.type == "cuda" and fits else "disk"
        if kind == "disk":
            return DiskStore(self.layout)
        if kind == "ram":
            return RamStore(self.layout, pin=self.device.type == "cuda", progress=progress)
        raise MoEScopeError(f"unknown store '{kind}'; use disk, ram or auto")

    def _plan(self, spec: BudgetSpec) -> BudgetPlan:
        return plan_budget(self.layout, spec.resolve_bytes(self.layout.all_expert_bytes, self.layout.slot_bytes))

    # ----- live changes (between tokens) -----
    def set_budget(self, budget: str | BudgetSpec) -> BudgetPlan:
        spec = parse_budget(budget) if isinstance(budget, str) else budget
        self.plan = self._plan(spec)
        self.cache.resize(self.plan.slots_per_layer)
        return self.plan

    def set_policy(self, name: str) -> None:
        policy = make_policy(name)
        policy.reset(self.layout.num_layers, self.layout.num_experts, self.layout.top_k)
        for layer in range(self.layout.num_layers):
            for expert in self.cache.directory.resident(layer):
                policy.on_insert(layer, expert)
        self.cache.directory.policy = policy
        self.options.policy = name

    # ----- facts -----
    @property
    def context_length(self) -> int:
        config = self.model.config
        return int(getattr(config, "max_position_embeddings", 0) or 1 << 30)

    def info(self) -> ModelInfo:
        return describe(self.files, self.layout, self.model.config, self.dtype, str(self.device), self.store.kind)

    def close(self) -> None:
        self.cache.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
