"""A loaded model ready to generate: weights, tokenizer, store, cache, counters, decode paths."""

from __future__ import annotations

import time
from collections import Counter

import psutil
import torch

from engine import protocol as p
from engine.accounting.counters import EngineCounters
from engine.accounting.planner import ALLOCATIONS, BudgetPlan, plan_budget
from engine.accounting.policies import make_policy
from engine.accounting.policies.base import CachePolicy
from engine.accounting.sizes import BudgetSpec, parse_budget
from engine.decode import block_diffusion
from engine.decode.kv_cache import new_cache
from engine.decode.native import kernels as native
from engine.decode.paths.base import PathChooser, Step
from engine.decode.paths.context import DecodeContext, DecodeSettings
from engine.decode.paths.native_layers import NativeLayersPath, NativePromptPath
from engine.decode.paths.transformers_path import TransformersPath, last_position
from engine.decode.paths.whole_token import WholeTokenPath
from engine.decode.routers import RouterTaps, RoutingRestriction
from engine.decode.sequence import PREFILL_CHUNK_TOKENS
from engine.errors import MoEScopeError
from engine.formats.blocks import BlockFormat, format_name, parse_format
from engine.formats.dequantize import reference_dequantizer
from engine.formats.quantize import reference_quantizer
from engine.hub.local import resolve_model
from engine.model import experts_registry
from engine.model.conversion_cache import files_identity
from engine.model.dense_quantize import DenseCache, QuantizedLinear, quantize_dense
from engine.model.gguf.loader import gguf_tokenizer
from engine.model.inspect import ModelInfo, describe, host_tensor_bytes
from engine.model.loaded import LoadedWeights
from engine.model.loader import ProgressFn, build_model, resolve_device
from engine.model.model_class import is_block_diffusion
from engine.offload import packed_linear
from engine.offload.expert_cache import ExpertCache
from engine.offload.quantized_store import quantize_layout
from engine.offload.store import DiskStore, ExpertStore, RamStore
from engine.system import collector, huge_pages, memory
from engine.system.progress import with_time_left


def _parse_format(name: str, what: str) -> BlockFormat | None:
    try:
        return parse_format(name)
    except ValueError as exc:
        raise MoEScopeError(f"{what} format: {exc}") from None


# The load's first forward: a prompt (the prefill path) of one token repeated. Identical tokens
# route alike (their attention averages identical values), so it loads about one token's experts,
# and its working memory is a short message's, counted in the overhead.
FIRST_FORWARD_TOKENS = 16
NO_TOKENIZER_LIMIT = int(1e30)  # what transformers itself sets for a tokenizer without a length limit


class MoERuntime:
    """`settings` are what the user asked for at load and stay as given; what changes live (budget,
    policy, exact or native decode kernels) is this object's own state. `cache_type`: benchmarks substitute a subclass
    of `ExpertCache` (bench/routing.py)."""

    def __init__(self, settings: p.LoadModel, progress: ProgressFn | None = None,
                 cache_type: type[ExpertCache] = ExpertCache) -> None:
        started = time.perf_counter()
        baseline = memory.baseline_rss_bytes()  # before this process reads any weights
        self.settings = settings
        loaded = self._load_weights(progress)
        self._apply_formats(loaded, progress)
        huge_pages.gather(self.model, skip=self._read_by_rows())  # the dense weights in 2 MiB pages, side by side
        memory.release_file_pages(self.files.files)  # the pages that copy read: the dense weights a second time
        self.tokenizer = self._load_tokenizer(loaded)
        self.store = self._open_store(settings.store, progress)
        # the native kernels from the first token: asked for, and they can run here
        native_first = settings.fast_decode and self.fast_decode_available
        policy = self._plan_cache(cache_type, native_first)
        self._choose_paths(native_first)
        self._prepare(policy)
        forward_peak = self._warm(progress)
        self.tracer = None
        if settings.trace:
            self.start_trace(settings.trace)
        collector.freeze_loaded()  # no full pass of the cycle collector walks the model mid-reply
        self._measure_overhead(baseline, forward_peak)
        self.load_seconds = time.perf_counter() - started

    # ----- setup -----
    def _load_weights(self, progress: ProgressFn | None) -> LoadedWeights:
        """The model built on its device, with its layout and files; the load's result for the later steps."""
        options = self.settings
        self.device = resolve_device(options.device)
        loaded = build_model(
            resolve_model(options.path),
            device=self.device,
            dtype=options.dtype,
            allow_pickle=options.allow_pickle,
            trust_remote_code=options.trust_remote_code,
            progress=progress,
        )
        self.model, self.layout, self.files, self.dtype = loaded.model, loaded.layout, loaded.files, loaded.dtype
        self.text_only = loaded.text_only
        self.block_diffusion = is_block_diffusion(type(self.model))  # replies run the model's own loop
        return loaded

    def _apply_formats(self, loaded: LoadedWeights, progress: ProgressFn | None) -> None:
        """The experts and dense weights converted to the block formats asked for (or kept as stored)."""
        self.expert_format = _parse_format(self.settings.expert_format, "expert")
        self.dense_format = _parse_format(self.settings.dense_format, "dense")
        self.format_notes: list[str] = list(loaded.notes)
        if loaded.gguf is not None and self.expert_format is not None and self.layout.quantized:
            raise MoEScopeError(
                f"the experts of '{self.files.root.name}' are stored in {self.layout.expert_format.label} already; "
                "--expert-format converts bf16/fp16/fp32 (or MXFP4/FP8 checkpoint) experts, so leave it at "
                "original for this GGUF file")
        # a conversion quantizes on the native kernels where they load (loading them here), the same bytes
        quantizer = native.quantizer(reference_quantizer)
        if self.expert_format is not None and self.expert_format is not self.layout.expert_format:
            self.layout, notes = quantize_layout(self.layout, self.expert_format, self.fingerprint,
                                                  progress=with_time_left(progress), quantizer=quantizer)
            self.format_notes += notes
        if self.dense_format is not None:
            cache = DenseCache.of(self.fingerprint, self.files.files, self.dtype, self.dense_format)
            self.format_notes += quantize_dense(self.model, self.dense_format, set(self.layout.module_paths),
                                                cache, with_time_left(progress), quantizer)
        for module in self.model.modules():  # converted above, or kept in a GGUF file's blocks
            if isinstance(module, QuantizedLinear):  # the native expansion once built: the same values
                module.dequantizer = native.slot_dequantizer(reference_dequantizer)

    def _load_tokenizer(self, loaded: LoadedWeights):
        """The model's tokenizer; None for checkpoints without tokenizer files (they run on token ids,
        --prompt-ids)."""
        from transformers import AutoTokenizer

        tokenizer = None
        if loaded.gguf is not None:
            tokenizer = gguf_tokenizer(loaded.gguf)
        elif any((self.files.root / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            tokenizer = AutoTokenizer.from_pretrained(self.files.root, trust_remote_code=self.settings.trust_remote_code)
        if tokenizer is not None:  # the generation loop checks prompts against the context and says it in
            # one line; the tokenizer's own warning ("... will result in indexing errors") would come first
            tokenizer.model_max_length = NO_TOKENIZER_LIMIT
        return tokenizer

    def _plan_cache(self, cache_type: type[ExpertCache], native_first: bool) -> CachePolicy:
        """The counters, the budget's plan and the expert cache under the asked policy (returned, for
        `_prepare`), attached to the model's experts modules."""
        options = self.settings
        self.counters = EngineCounters(self.layout.num_layers, self.layout.num_experts)
        if options.allocation not in ALLOCATIONS:
            raise MoEScopeError(f"unknown allocation '{options.allocation}'; use planned or uniform")
        self.plan = self._plan(parse_budget(options.budget))
        self.policy_spec = options.policy
        self.profile_note = ""
        policy = make_policy(options.policy)
        self.routers = RouterTaps(self.model, self.layout)
        self.cache = cache_type(
            self.layout, self.store, self.device, policy, self.plan.slots_per_layer, self.counters,
            predictor=self.routers,
            # the native experts kernel reads plain weights faster than oneDNN reads packed ones
            packed_params=self._packable() if options.pack_weights and not native_first else frozenset(),
        )
        if self.layout.quantized:  # the native expansion where the kernels load: the same values, faster
            self.cache.use_dequantizer(native.slot_dequantizer(reference_dequantizer))
            # loaded with --exact too: the torch reference expands a slot through float32
            # temporaries several times its size, which a prefill pays in time and memory
            native.load()
        for module_path, layer in self.layout.experts_modules():
            experts_registry.attach(self.model.get_submodule(module_path), self.cache, layer)
        return policy

    def _choose_paths(self, native_first: bool) -> None:
        """The decode paths, fastest first, and the live switches they read, as the settings ask."""
        self._restriction: RoutingRestriction | None = None
        self.decode_settings = DecodeSettings()  # live: fast decode, 8-bit inputs, restricted routing
        context = DecodeContext(self.model, self.cache, self.device, self.dtype, self.decode_settings)
        self.native_layers = NativeLayersPath(context)
        self.whole_token = WholeTokenPath(context)
        self.paths = PathChooser([self.whole_token, self.native_layers, NativePromptPath(context, self.native_layers),
                                  TransformersPath(self.model)])
        self.decode_path = ""  # how the last decode token ran, in words (a DecodePath's label)
        self.decode_path_reason = ""  # why the next faster path did not run it
        self.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS  # a prompt's tokens per forward (engine.decode.sequence)
        self.set_fast_decode(self.settings.fast_decode)
        self.int8_inputs = self.settings.int8_inputs
        if native_first:
            native.load()  # at load: the first tokens should not run on the slower kernels

    def _warm(self, progress: ProgressFn | None) -> int:
        """The cache filled, CPU experts set up and a first forward run, where asked for; the forward's
        peak RSS in bytes (0 when none ran or the platform cannot tell)."""
        options = self.settings
        self.warm_bytes = self.cache.warm() if options.warm else 0
        self.cpu_experts_note = self._setup_cpu_experts(options.cpu_experts)
        if not options.warm:
            return 0
        if progress is not None:
            progress(1.0, "a first forward (torch sets up its kernels)")
        memory.release_free_heap()  # the load's own temporaries are not a forward's working memory
        measured = memory.reset_phase_peak()
        self._first_forward()
        return memory.phase_peak_rss_bytes() if measured else 0

    def _measure_overhead(self, baseline: int, forward_peak: int) -> None:
        """The heap settled for the replies, then what the engine holds beyond the weights, noted for
        the memory panel."""
        memory.release_free_heap()
        memory.keep_freed_heap()  # from here on the heap holds working memory, reused step after step
        self.overhead = memory.EngineOverhead(baseline, memory.rss_bytes(), host_tensor_bytes(self.model),
                                              self._host_expert_bytes(), forward_peak)
        memory.note_overhead(self.overhead)

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
        requested = spec.resolve_bytes(self.layout.all_expert_bytes, self.layout.slot_bytes)
        curves = self.miss_curves() if self.settings.allocation == "planned" else None
        return plan_budget(self.layout, requested, curves=curves, allocation=self.settings.allocation)

    def _host_expert_bytes(self) -> int:
        """Expert bytes in this process's memory now: the RAM store, and on a CPU the slots filled so far."""
        store = self.layout.all_expert_bytes if self.store.kind == "ram" else 0
        return store + (self.warm_bytes if self.device.type == "cpu" else 0)

    def _setup_cpu_experts(self, mode: str) -> str:
        """Fiddler's CPU execution of misses: only with a GPU and the RAM store; a no-op otherwise."""
        if mode not in ("auto", "never"):
            raise MoEScopeError(f"unknown --cpu-experts '{mode}'; use auto or never")
        if mode == "never":
            return ""
        from engine.offload import cpu_experts

        first = self.model.get_submodule(self.layout.module_paths[0])
        if not cpu_experts.supported(first, self.store, self.device):
            return "--cpu-experts auto has no effect here (it needs a CUDA GPU and the RAM store)"
        hidden = self.model.config.get_text_config().hidden_size
        model = cpu_experts.calibrate(self.layout, self.store, first, self.device, hidden)
        self.cache.cpu_experts = cpu_experts.CpuExperts(self.layout, self.store, model)
        return ""

    @torch.inference_mode()
    def _first_forward(self) -> None:
        """A short prompt and one decoded token through the paths a reply takes, then forgotten (the
        counters start afresh; the policy keeps what it saw, as it keeps a calibration run). What torch
        and the decode paths set up on first use (oneDNN's generated kernels, code pages, a quantized
        slot's dequantization scratch, the fast step's buffers) is then in place before the first
        reply, and counted in the overhead measured at the end of the load, like vLLM's profile run."""
        context = self.context_length
        vocab = self.model.config.get_text_config().vocab_size
        prompt = [1 % vocab] * max(1, min(FIRST_FORWARD_TOKENS, context - 2))
        step = Step(torch.tensor([prompt], dtype=torch.long, device=self.device), new_cache(self.model), 0)
        self.counters.start_request()
        self.cache.policy.on_request_start()
        if self.block_diffusion:  # the prompt through the encoder, then one denoising forward of a canvas
            self._read_prompt(step.input_ids)
        else:
            for _ in range(2 if context > len(prompt) + 1 else 1):  # the prefill, then one decode step
                logits = self._step_alone(step)
                token = logits[0, -1].argmax().view(1, 1)
                step = Step(token, step.kv, step.position + step.input_ids.shape[1])
        self.cache.settle()
        self.counters = self.cache.counters = EngineCounters(self.layout.num_layers, self.layout.num_experts)

    @torch.inference_mode()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Every position's logits [n, vocab] of `ids` read as one new prompt, on the path a prompt
        takes now (its opt-in lossy modes included): what teacher-forced scoring reads. One token to
        the counters and the policy."""
        if self.block_diffusion:
            raise MoEScopeError(f"{type(self.model).__name__} denoises blocks of tokens together; teacher-forced "
                                "scoring (perplexity, answer log-probabilities) needs a model that writes token by token")
        step = Step(torch.tensor([ids], dtype=torch.long, device=self.device), new_cache(self.model), 0,
                    every_position=True)
        return self._step_alone(step)[0]

    def _step_alone(self, step: Step) -> torch.Tensor:
        """`step` on the path that can run it now, counted as one token, outside any reply's loop."""
        logits = self.paths.choose(step)[0].run(step)
        self.counters.end_token()
        self.cache.policy.on_token_end()
        return logits

    # ----- policies -----
    def _prepare(self, policy: CachePolicy) -> None:
        """What a policy needs from the model: a calibration profile, or hooks on the routers."""
        if self._restriction is not None:
            self._restriction.remove()
            self._restriction = None
            self.decode_settings.routing_restricted = False
        if policy.restricts_routing:
            directory, top_k = self.cache.directory, self.layout.top_k

            def allowed(layer: int) -> list[int]:
                ready = directory.ready(layer)  # loading experts only if too few are ready for one token
                return ready if len(ready) >= top_k else directory.resident(layer)

            try:
                self._restriction = RoutingRestriction(self.routers, allowed, policy)
            except RuntimeError as exc:
                raise MoEScopeError(f"policy '{policy.name}' cannot run on this model: {exc}") from None
            self.decode_settings.routing_restricted = True
        if policy.needs_profile:
            policy.set_profile(self._profile())

    def _profile(self):
        """This model's saved calibration profile, else the routing seen so far, else a calibration run."""
        from engine.accounting import profiles

        # keyed by the files too: a fine-tune shares its base model's fingerprint, not its routing
        path = profiles.profile_path(f"{self.fingerprint}-{files_identity(self.files.files)}")
        counts = profiles.load_profile(path, (self.layout.num_layers, self.layout.num_experts))
        if counts is not None:
            self.profile_note = f"popularity profile from {path}"
            return counts
        if self.counters.activation_total.sum() > 0:
            self.profile_note = "popularity profile from this session's routing (no saved profile)"
            return self.counters.activation_total.copy()
        counts = self.calibrate_profile()
        profiles.save_profile(path, counts, source="calibration prompts")
        self.profile_note = f"calibrated a popularity profile on built-in prompts; saved to {path}"
        return counts

    @torch.inference_mode()
    def calibrate_profile(self):
        """Routing counts of a prefill over the built-in calibration prompts, through the engine."""
        from engine.accounting import profiles

        before = self.counters.activation_total.copy()
        vocab = self.model.config.get_text_config().vocab_size
        for ids in profiles.calibration_ids(self.tokenizer, vocab):
            ids = ids[: max(2, self.context_length - 1)]
            self._read_prompt(torch.tensor([ids], dtype=torch.long, device=self.device))
        return self.counters.activation_total - before

    def _read_prompt(self, ids: torch.Tensor) -> None:
        """One forward over a prompt for what it routes, outside any reply, counted as one token. A
        block-diffusion model reads it as its generate does (its encoder), plus one denoising forward of a
        random canvas, the least its own loop runs."""
        if self.block_diffusion:
            block_diffusion.denoise(self.model, ids, block_diffusion.GREEDY_SEED, 1, max_denoising_steps=1)
        else:
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                       logits_to_keep=last_position(ids))
        self.counters.end_token()
        self.cache.policy.on_token_end()

    @property
    def fingerprint(self) -> str:
        from engine.accounting import profiles

        index = [(t.name, tuple(t.shape), t.dtype) for t in self.files.tensors.values()]
        return profiles.fingerprint(self.files.config, index)

    # ----- live changes (between tokens) -----
    def set_budget(self, budget: str | BudgetSpec) -> BudgetPlan:
        """Re-plan the cache for a new budget (from the routing seen so far when allocation is planned)."""
        spec = parse_budget(budget) if isinstance(budget, str) else budget
        self.plan = self._plan(spec)
        self.cache.resize(self.plan.slots_per_layer)
        return self.plan

    def _read_by_rows(self) -> list[torch.Tensor]:
        """The input embedding, of which a token reads one row: left where it is (it can be the
        largest dense tensor) unless the LM head shares it and reads all of it."""
        embedding = getattr(self.model.get_input_embeddings(), "weight", None)
        head = self.model.get_output_embeddings()
        # a quantized head shares nothing, and its `weight` would expand the whole matrix to ask
        shared = head is not None and not isinstance(head, QuantizedLinear) and getattr(head, "weight", None) is embedding
        if embedding is None or shared:
            return []
        return [embedding]

    def _packable(self) -> frozenset[str]:
        """Expert matrices the cache can keep pre-arranged for oneDNN (CPU, bf16/fp16, [out, in]),
        when every expert is resident: below `all`, packing would sit on every miss's path."""
        experts = self.model.get_submodule(self.layout.module_paths[0])
        if (self.device.type != "cpu" or getattr(experts, "is_transposed", False) or self.layout.quantized
                or not packed_linear.available(self.dtype)):
            return frozenset()
        if any(n < self.layout.num_experts for n in self.plan.slots_per_layer):
            return frozenset()
        return frozenset(p.name for p in self.layout.params if p.name in packed_linear.PACKABLE and len(p.shape) == 2)

    @property
    def fast_decode_available(self) -> bool:
        """The switch changes something here: a CPU engine running bf16 weights (the native kernels')."""
        return self.device.type == "cpu" and self.dtype == torch.bfloat16

    def set_fast_decode(self, enabled: bool) -> bool:
        """Ask for the native decode paths (True) or transformers' exact kernels (False), between tokens;
        returns whether the native ones are on now. Asked for where they cannot run (a GPU, a float32
        model), decode stays exact and the path chooser says why."""
        if enabled and self.fast_decode_available:
            self.native_layers.enable()  # idempotent: the modules deviate only inside a native step
            if not native.failed():
                self.cache.unpack()  # the native experts kernel reads plain weights (for the rest of the session)
        self.decode_settings.fast_decode = enabled
        return self.fast_decode_on

    @property
    def fast_decode(self) -> bool:
        """The native decode paths asked for (live: the System panel's "Exact" switch); they run where available."""
        return self.decode_settings.fast_decode

    @property
    def int8_inputs(self) -> bool:
        """The opt-in, lossy 8-bit inputs asked for (live: the System panel's switch)."""
        return self.decode_settings.int8_inputs

    @int8_inputs.setter
    def int8_inputs(self, enabled: bool) -> None:
        self.decode_settings.int8_inputs = enabled

    @property
    def fast_decode_on(self) -> bool:
        return self.fast_decode and self.fast_decode_available

    @property
    def format_names(self) -> tuple[str, str]:
        """(experts, dense) as loaded: "original" or a block format's name (q4_k, ...)."""
        # a quantized checkpoint's experts are in its own format (mxfp4, fp8) unless converted
        experts = format_name(self.expert_format or self.layout.expert_format)
        if self.dense_format is not None:
            return experts, format_name(self.dense_format)
        # a GGUF file's dense weights kept in their blocks: the type most of them are in
        kept = Counter(m.fmt.name for m in self.model.modules() if isinstance(m, QuantizedLinear))
        return experts, kept.most_common(1)[0][0] if kept else "original"

    @property
    def routing_restricted(self) -> bool:
        """A lossy policy rewrites the routers' choices, layer by layer."""
        return self.decode_settings.routing_restricted

    def set_policy(self, name: str) -> None:
        """Switch policy between tokens: residents stay; the new policy learns from here on."""
        policy = make_policy(name)
        self.cache.set_policy(policy)
        self._prepare(policy)
        self.policy_spec = name

    # ----- observation -----
    def miss_curves(self):
        """[layers, experts + 1] float32 expected misses per token with s slots, from routing since load."""
        recorder = self.counters.miss_curves
        return recorder.curves() if recorder.has_data() else None

    def policy_stats(self) -> dict[str, float]:
        """Prefetch outcomes and the policy's own figures (for `TelemetrySnapshot.extra`)."""
        return self.cache.stats()

    def start_trace(self, path: str) -> None:
        from engine.traces.trace import TraceWriter

        self.stop_trace()
        header = {"model": self.files.root.name, "fingerprint": self.fingerprint,
                  "num_layers": self.layout.num_layers, "num_experts": self.layout.num_experts,
                  "top_k": self.layout.top_k, "expert_bytes": self.layout.slot_bytes, "predict_window": 3}
        try:
            self.tracer = TraceWriter(path, header, lambda: self.counters.requests_started)
        except OSError as exc:
            raise MoEScopeError(f"cannot write the trace {path}: {exc.strerror or exc}") from None
        self.cache.tracer = self.tracer

    def stop_trace(self) -> None:
        if getattr(self, "tracer", None) is not None:
            self.cache.tracer = None
            self.tracer.close()
            self.tracer = None

    # ----- facts -----
    @property
    def context_length(self) -> int:
        config = self.model.config.get_text_config()  # a multimodal model's text part
        return int(getattr(config, "max_position_embeddings", 0) or 1 << 30)

    def load_notes(self) -> list[str]:
        """What the load decided that the user should know (the budget's own note is the planner's)."""
        sampling = block_diffusion.SAMPLING_NOTE if self.block_diffusion else ""
        return [n for n in (*self.format_notes, self.profile_note, self.cpu_experts_note, sampling) if n]

    def info(self) -> ModelInfo:
        info = describe(self.files, self.layout, self.model.config, self.dtype, str(self.device), self.store.kind,
                        self.text_only)
        info.engine_overhead_bytes = self.overhead.total_bytes
        return info

    def close(self) -> None:
        collector.unfreeze_for_unload()
        self.stop_trace()
        if self._restriction is not None:
            self._restriction.remove()
        self.cache.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
