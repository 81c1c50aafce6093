"""The native per-layer path (the default decode; `--exact` turns it off): a decode token through the model's own forward,
with the modules the native kernels compute switched onto them. The same arithmetic as
transformers, summed in a different order: faster, not bit-identical.

For one new token (a prompt keeps transformers' kernels but for its quantized experts, plain
linears and routers: `NativePromptPath`), while the path runs:
- a layer's resident experts run in one native call (gate/up, gate, down, biases, weighted sum)
  when their recipe is one the kernel computes (engine.decode.modules.expert_recipe: every family
  whose experts are gated MLPs): the expert cache is handed that kernel (`ExpertCache.experts_kernel`);
- plain bf16 `nn.Linear`s of one row (biased or not) use the native GEMV, Llama-style RMSNorms one call instead
  of eight small ops, Llama-style attention three (q/k/v with q/k norms and rotary, attention over
  the KV cache, o_proj) instead of ~60, DeepSeek-V3-style latent attention over the cached latents
  with its up-projection absorbed (engine.decode.modules.latent_attention), and listed top-k routers
  the GEMV for their linear;
- other attention of one query (SDPA or eager, with attention sinks and additive masks) runs as two
  float32 matmuls and a softmax (engine.decode.modules.one_query_attention).
Which modules qualify is decided by their class (engine.decode.modules.families). Each patched
module reads a switch that belongs to its model and is on only inside this path's `run`, so
outside it every module computes exactly as transformers does; no process-wide torch setting
is touched. The patched modules are engine.decode.modules.native_modules, the experts kernels
engine.decode.modules.native_experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from engine.decode.layer_gather import LayerGather
from engine.decode.modules.native_experts import NativeExperts, NativePromptExperts, quantized_product
from engine.decode.modules.native_modules import install
from engine.decode.modules.switch import NativeSwitch
from engine.decode.native import kernels as native
from engine.decode.paths.base import DecodePath, Step, Together
from engine.decode.paths.context import DecodeContext
from engine.decode.paths.packed_prompts import packable, packed_forward, packs, smallest_window
from engine.decode.paths.transformers_path import model_forward
from engine.offload.expert_compute import PromptKernels

# what a native path's label adds while the opt-in 8-bit inputs are on (the System panel shows it)
INT8_LABEL = ", 8-bit inputs to K-quant matrices (lossy)"


def int8_label(context: DecodeContext) -> str:
    return INT8_LABEL if context.settings.int8_inputs else ""


def kernels_problem(context: DecodeContext) -> str | None:
    """Why the native kernels cannot run for this model now (every native path asks); None when they can."""
    if not context.settings.fast_decode:
        return "exact kernels were asked for (--exact, or the System panel's Exact switch)"
    if context.device.type != "cpu":
        return "the native kernels run on the CPU"
    if context.dtype != torch.bfloat16:
        return f"the native kernels compute bf16 weights; this model runs in {str(context.dtype).removeprefix('torch.')}"
    if native.ready() is None:
        return native.status()
    return None


def native_problem(context: DecodeContext, step: Step, short_prompts: bool = False) -> str | None:
    """Why no native kernel can run `step` (shared by both native decode paths; `short_prompts`: the
    path takes short prompts too); None when they can."""
    if step.prefill and context.settings.fast_decode and not short_prompts:
        return "prompts (prefill) run on transformers' kernels"
    if problem := kernels_problem(context):
        return problem
    if context.cache.packed_params:
        return "the expert matrices are packed for oneDNN (they are unpacked when the Exact switch is turned off)"
    return None


class NativePromptPath(DecodePath):
    """A prompt's forward on transformers' kernels, with quantized experts multiplied in their blocks
    by the native kernels (the exact path expands each into a scratch for oneDNN, which re-packs it),
    and the plain linears and routers on `linear_rows`: oneDNN makes and keeps a kernel for every
    new row count, which grew the process by about half a MiB per linear shape and prompt length.
    bf16 experts take the native call too where it beats torch's bf16 matmul (CPUs where that has
    no oneDNN kernel)."""

    def __init__(self, context: DecodeContext, native_layers: NativeLayersPath) -> None:
        self.context = context
        self.native_layers = native_layers  # its switch, once installed, takes the prompt's linears onto the kernels
        self._packs: bool | None = None  # the model takes packed prompts (engine.decode.paths.packed_prompts)
        self._window: int | None = None  # and its narrowest attention window

    @property
    def label(self) -> str:
        tiles = self._tiles()
        asked = self.context.settings.int8_inputs
        if asked and not tiles:
            return f"fast: prompt's experts and linears on the native kernels{INT8_LABEL}"
        unused = "; 8-bit inputs not used: the tiles are faster" if asked else ""
        return f"fast: prompt's experts and linears on the native kernels{' (AMX tiles)' if tiles else ''}{unused}"

    @staticmethod
    def _tiles() -> bool:
        kernels = native.ready()
        return kernels is not None and kernels.amx()

    def _int8(self) -> bool:
        """The lossy 8-bit inputs for a prompt, where asked for and they pay: not beside AMX tiles, whose bf16
        products are the faster there (docs/performance-history.md, "AMX tiles for prompts"), so the
        request is set aside there and the path's label says so."""
        return self.context.settings.int8_inputs and not self._tiles()

    def unavailable(self, step: Step) -> str | None:
        if not step.prefill:
            return "one-token steps take the decode paths"
        if problem := kernels_problem(self.context):
            return problem
        if not self.context.cache.quantized_slots and not native.bf16_prompt_beats_torch(native.ready()):
            return "the experts are bf16 and oneDNN's bf16 matmuls are the faster here: transformers' kernels run the prompt"
        return None

    def run(self, step: Step) -> torch.Tensor:
        with self._prompt_context():
            return model_forward(self.context.model, step)

    def can_run_together(self, step: Step) -> bool:
        if self._packs is None:
            model = self.context.model
            self._packs, self._window = packs(model), smallest_window(model)
        # a trace records a forward's routing as one request's: traced prompts go one at a time
        return self._packs and self.context.cache.tracer is None and packable(step, self._window)

    def run_together(self, steps: list[Step]) -> Together:
        """Fresh replies' prompts in one forward (engine.decode.paths.packed_prompts)."""
        with self._prompt_context():
            logits = packed_forward(self.context.model, steps)
        return Together(logits, [None] * len(steps), 0, 0)

    @contextmanager
    def _prompt_context(self) -> Iterator[None]:
        kernels = native.ready()
        switch = self.native_layers.switch  # installed when fast decode was turned on
        int8 = self._int8()
        kernels.use_int8_inputs(int8)
        with self.context.cache.prompt_kernels(PromptKernels(NativePromptExperts(kernels, int8),
                                                             quantized_product(kernels), kernels.combine_rows)), \
                switch.prompt_rows(int8=int8) if switch is not None else nullcontext():
            yield


class NativeLayersPath(DecodePath):
    """The model's forward with its qualifying modules and the experts on the native kernels."""

    def __init__(self, context: DecodeContext) -> None:
        self.context = context
        self._switch: NativeSwitch | None = None
        self._gather: LayerGather | None = None  # made at the first steps run together

    @property
    def label(self) -> str:
        return f"fast: native kernels, layer by layer{int8_label(self.context)}"

    @property
    def switch(self) -> NativeSwitch | None:
        return self._switch

    def enable(self) -> None:
        """Fast decode was asked for: patch the model's modules (once) and load the kernels."""
        if self._switch is None:
            self._switch = install(self.context.model)
        native.load()

    def unavailable(self, step: Step) -> str | None:
        problem = native_problem(self.context, step)
        if problem is None and self._switch is None:
            return "the native kernels were not set up for this model"
        return problem

    def run(self, step: Step) -> torch.Tensor:
        with self._decode_context():
            return model_forward(self.context.model, step)

    def can_run_together(self, step: Step) -> bool:
        return not step.prefill

    def run_together(self, steps: list[Step]) -> Together:
        """Each step's model forward, their MoE layers gathered into one computation (engine.decode.layer_gather)."""
        if self._gather is None:
            self._gather = LayerGather(self.context.cache)
        gather = self._gather
        with self._decode_context():
            logits = gather.run([lambda s=step: model_forward(self.context.model, s) for step in steps])
        return Together(logits, gather.picks, gather.uses, gather.distinct)

    @contextmanager
    def _decode_context(self) -> Iterator[None]:
        """The decode settings, and the prompt's native kernels for the many rows of a gathered layer."""
        kernels = native.ready()
        int8 = self.context.settings.int8_inputs
        kernels.use_int8_inputs(int8)
        prompt = PromptKernels(NativePromptExperts(kernels, int8), quantized_product(kernels), kernels.combine_rows)
        with self._switch.active(), self.context.cache.experts_kernel(NativeExperts(kernels)), \
                self.context.cache.prompt_kernels(prompt):
            yield
