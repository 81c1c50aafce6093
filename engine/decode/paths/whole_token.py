"""The whole-token path (default decode; not with `--exact`): one native call per decode token when every expert is resident.

The native per-layer path (engine.decode.paths.native_layers) runs each layer's weights at close
to the memory bandwidth, but a Qwen3-MoE-shaped token still spent much of its time in
Python and small torch ops between those kernels (decoder-layer calls, residual adds, the rotary table, the
mask, module lookups, the router's softmax and top-k as separate ops). For the decoders whose
every piece the native kernels compute (engine.decode.modules.families: Qwen3-MoE, Qwen2-MoE
with its biased q/k/v and gated shared expert, OLMoE with its full-width q/k norms, Mixtral,
GPT-OSS with its attention sinks, biases, sliding windows, clamped SwiGLU experts and its own
router and norms, DeepSeek-V3 / GLM-4.7-Flash with their latent attention (absorbed, as the
per-layer path computes it), and GLM-4.5 (glm4_moe) with its partial rotary embedding; the last
three with grouped sigmoid routers, shared experts and dense first layers; as transformers writes
them, bf16 or block formats on the CPU),
`WholeTokenStep.step` (engine.decode.modules.whole_token_step) runs the embedding, every layer
and the lm_head in one call (`NativeWholeTokenStep`, over src/step/whole_token_step.h), with the same
kernels in the same order; the expert cache then records the token from the picks it returns,
through the same `record` the per-layer path uses.

A short prompt runs as the rows of one step (at most `MAX_ROWS` tokens into an empty cache,
each row attending to itself and the rows before it), with the decode token's arithmetic: the same
bits as its tokens fed one by one.

Several replies' forwards run as one step (`run_together`, `WholeTokenStep.step_parts`): the
decoding ones' tokens and the new ones' short prompts, as llama.cpp's server batches its slots'
tokens. Every weight is read once for all of them and each expert of their union once, and each
reply gets the logits it gets alone (the same sums; GPT-OSS's transposed experts run one reply at a
time).

It applies only while every expert of every layer is resident and nothing needs a layer's
routing as it happens (a lookahead policy, a trace, a routing restriction); otherwise, and for
a longer prompt, another path runs.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.accounting.routing import picks_and_distinct
from engine.decode.kv_cache import BlockLayer, BlockSlidingLayer
from engine.decode.modules.families import attention_windows
from engine.decode.modules.whole_token_step import WholeTokenStep, recognise, slots_problem
from engine.decode.native import kernels as native
from engine.decode.native.library import NativeWholeTokenStep
from engine.decode.paths.base import DecodePath, Step, Together
from engine.decode.paths.context import DecodeContext
from engine.decode.paths.native_layers import int8_label, native_problem


class WholeTokenPath(DecodePath):
    def __init__(self, context: DecodeContext) -> None:
        self.context = context
        self._problem: str | None = None  # why this model has no whole-token step ("" = it has one)
        self._decoder: WholeTokenStep | None = None
        self._windows: list[int | None] = []  # each layer's attention window, if it slides

    @property
    def label(self) -> str:
        return f"fast: whole token in one native call{int8_label(self.context)}"

    def unavailable(self, step: Step) -> str | None:
        context = self.context
        problem = native_problem(context, step, short_prompts=True)
        if problem is not None:
            return problem
        if self._problem is None:
            self._problem = recognise(context.model) or slots_problem(context.model, context.cache.reader)
            if not self._problem:
                self._windows = attention_windows(context.model)
        if self._problem:
            return self._problem
        if context.settings.routing_restricted:
            return "the policy restricts routing to resident experts, layer by layer"
        if problem := context.cache.whole_token_problem():
            return problem
        if step.prefill and (problem := self._prompt_problem(step)):
            return problem
        return _cache_problem(step.kv.layers, self._windows, step.position + step.input_ids.shape[1] - 1)

    def _prompt_problem(self, step: Step) -> str | None:
        """Why a prompt cannot run as the rows of one step (None when it can: a short one, into an empty cache)."""
        if step.position or step.kv is None or step.every_position:
            return "prompts go into an empty cache, their last position's logits only"
        if step.input_ids.shape[1] > NativeWholeTokenStep.MAX_ROWS:
            return f"prompts of more than {NativeWholeTokenStep.MAX_ROWS} tokens take the prompt path"
        if self.decoder.transposed:
            return "transposed experts (GPT-OSS's) run one token per step"
        if any(window and step.input_ids.shape[1] >= window for window in self._windows):
            return "a prompt as long as an attention window takes the prompt path"
        return None

    def run(self, step: Step) -> torch.Tensor:
        return self._ready_decoder().step_parts([_part(step)])[0]

    def can_run_together(self, step: Step) -> bool:
        return True  # a decode token, or a short prompt: rows of one step either way

    def run_together(self, steps: list[Step]) -> Together:
        """The steps in as few native steps as their rows allow (at most `MAX_ROWS` rows each, a
        prompt's rows in one; GPT-OSS's transposed experts one step each)."""
        decoder = self._ready_decoder()
        most = 1 if decoder.transposed else NativeWholeTokenStep.MAX_ROWS
        calls: list[list[Step]] = []
        for step in steps:
            if not calls or sum(s.input_ids.shape[1] for s in calls[-1]) + step.input_ids.shape[1] > most:
                calls.append([])
            calls[-1].append(step)
        logits, picks = [], []
        for call in calls:
            out, experts = decoder.step_parts([_part(step) for step in call])
            logits.extend(out.split(1))
            picks.extend(None if step.prefill else e[0].astype(np.int16) for step, e in zip(call, experts, strict=True))
        decoding = [p for p in picks if p is not None]
        uses, distinct = picks_and_distinct(np.concatenate(decoding, axis=1)) if decoding else (0, 0)
        return Together(logits, picks, uses, distinct)

    def _ready_decoder(self) -> WholeTokenStep:
        """The decoder, its kernels set to this model's live input precision."""
        decoder = self.decoder
        decoder.kernels.use_int8_inputs(self.context.settings.int8_inputs)
        return decoder

    @property
    def decoder(self) -> WholeTokenStep:
        """The native step of this model, made on first use (call only when `recognise` accepts it)."""
        if self._decoder is None:
            self._decoder = WholeTokenStep(self.context.model, self.context.cache, native.load())
        return self._decoder


def _part(step: Step) -> tuple[list[int], object]:
    """A step as `WholeTokenStep.step_parts` takes it: its tokens and KV cache."""
    return (step.input_ids[0].tolist() if step.prefill else [step.last_token]), step.kv


def _cache_problem(layers, windows: list[int | None], position: int) -> str | None:
    """Why the step cannot attend over these KV cache layers at `position` (None when it can). A
    layer's attention window (the window each attention module was given, not the config's field:
    Qwen2-MoE keeps one there with `use_sliding_window` off) must be its cache layer's, which then
    keeps just the window's positions; over a cache layer that keeps everything, the step runs until
    the reply reaches the window."""
    for layer, window in zip(layers, windows, strict=True):
        kind = type(layer)
        if kind is BlockSlidingLayer:
            if layer.record_past:
                return "the KV cache keeps past positions for a rollback"
            if layer.sliding_window != window:
                return "a sliding-window KV cache layer under attention of another window"
        elif kind is not BlockLayer:
            return "the KV cache has layers of another kind"
        elif window and position + 1 > window:
            return "the reply reached the attention's sliding window"
    return None
