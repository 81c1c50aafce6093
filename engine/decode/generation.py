"""The generation loop: prefill, then one token at a time with a KV cache (gpt-fast style).

Between tokens it calls `between_tokens()`, where the caller applies live changes (budget,
policy) or asks to stop; text is streamed as deltas through `on_text`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from engine.decode import block_diffusion
from engine.decode.context_window import FittedPrompt, fit_chat
from engine.decode.kv_cache import new_cache
from engine.decode.paths.base import Step
from engine.decode.runtime import MoERuntime
from engine.decode.sampling import Sampler
from engine.errors import MoEScopeError, PromptTooLongError
from engine.protocol import ReplyStats, SamplingSettings
from engine.system.memory import peak_rss_bytes

TextFn = Callable[[str], None]
TokenFn = Callable[[int], None]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: ReplyStats = field(default_factory=ReplyStats)
    routed_experts: np.ndarray | None = None  # with keep_routing: [steps after the prompt, layers, top_k] int16

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason, "stats": asdict(self.stats)}


class Generator:
    def __init__(self, runtime: MoERuntime) -> None:
        self.runtime = runtime

    # ----- prompts -----
    def _tokenizer(self):
        if self.runtime.tokenizer is None:
            raise MoEScopeError("this checkpoint has no tokenizer files; pass token ids with --prompt-ids")
        return self.runtime.tokenizer

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        tok = self._tokenizer()
        if not getattr(tok, "chat_template", None):
            raise MoEScopeError("this model's tokenizer has no chat template; use --raw for plain text prompts")
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def fit_chat(self, messages: Sequence[dict], settings: SamplingSettings, overflow: str) -> FittedPrompt:
        """The chat's prompt within this model's context under the `overflow` policy
        (engine.decode.context_window): older turns left out, or PromptTooLongError naming the length."""
        return fit_chat(self.encode_chat, messages, self.runtime.context_length, settings.max_new_tokens, overflow)

    def encode_raw(self, text: str) -> list[int]:
        return list(self._tokenizer()(text, add_special_tokens=True)["input_ids"])

    def eos_ids(self) -> set[int]:
        """Stop tokens exactly as transformers' generate picks them: the generation config's, else the
        model config's. (Not the tokenizer's: generate does not look there either.)"""
        vocab = self.runtime.model.config.get_text_config().vocab_size
        for source in (getattr(self.runtime.model, "generation_config", None), self.runtime.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids = {value} if isinstance(value, int) else set(value or [])
            if ids:
                return {i for i in ids if 0 <= i < vocab}
        return set()

    # ----- the loop -----
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings,
        *,
        on_text: TextFn | None = None,
        on_token: TokenFn | None = None,
        between_tokens: Callable[[], bool] | None = None,
        keep_routing: bool = False,
        on_draft: TextFn | None = None,
    ) -> GenerationResult:
        rt = self.runtime
        context = rt.context_length
        if problem := settings.problem():
            raise MoEScopeError(f"{problem.field} {problem.message}")
        if not prompt_ids:
            raise MoEScopeError("the prompt is empty")
        if len(prompt_ids) >= context:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but this model's context is {context} tokens; shorten it"
            )
        max_new = min(settings.max_new_tokens, context - len(prompt_ids))
        counters = rt.counters
        counters.start_request()
        rt.cache.policy.on_request_start()
        reply = _Reply(rt.tokenizer, self.eos_ids(), settings.stop, max_new, on_text, on_token, between_tokens)
        timeline = _Timeline(rt)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=rt.device)
        if rt.block_diffusion:
            routed = self._denoise_blocks(ids, settings, reply, timeline, on_draft)
        else:
            routed = self._token_by_token(ids, settings, reply, timeline, keep_routing)
        t_end = time.perf_counter()
        generated = reply.tokens
        stats = ReplyStats(
            prefill_tokens=len(prompt_ids),
            decode_tokens=len(generated),
            ttft_s=timeline.t_first - timeline.t0,
            prefill_tokens_per_s=len(prompt_ids) / max(timeline.t_first - timeline.t0, 1e-9),
            decode_tokens_per_s=timeline.decode_rate(len(generated), t_end),
            hits=int(counters.request_layer_hits.sum()),
            misses=int(counters.request_layer_misses.sum()),
            bytes_loaded=counters.bytes_ondemand + counters.bytes_prefetch - timeline.bytes_at_start,
            decode_bytes_loaded=counters.bytes_ondemand + counters.bytes_prefetch - timeline.bytes_at_first,
            stall_s=counters.stall_s - timeline.stall_at_start,
            budget_bytes=rt.cache.budget_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            total_s=t_end - timeline.t0,
        )
        stats.hit_rate = counters.rate(stats.hits, stats.misses)
        stats.decode_hit_rate = counters.rate(timeline.decode_hits, timeline.decode_misses)
        routing = _stack_routing(routed, rt.counters.num_layers) if keep_routing else None
        return GenerationResult(generated, reply.text, reply.finish, stats, routing)

    def _token_by_token(self, ids: torch.Tensor, settings: SamplingSettings, reply: _Reply, timeline: _Timeline,
                        keep_routing: bool) -> list[np.ndarray]:
        """The autoregressive loop: the prompt, then one token at a time through the decode paths.
        Returns the experts each token after the prompt took (with `keep_routing`)."""
        rt = self.runtime
        counters = rt.counters
        prompt_length = ids.shape[1]
        sampler = Sampler(settings, rt.device, ids[0])
        cache = new_cache(rt.model)
        counters.keep_token_picks = keep_routing
        counters.take_token_picks()
        routed: list[np.ndarray] = []  # one [layers, top_k] per step after the prompt (a generated token fed back)
        step_input, token = ids, None
        for step in range(reply.limit):
            forward = Step(step_input, cache, prompt_length + len(reply.tokens) - step_input.shape[1], token=token)
            path, reason = rt.paths.choose(forward)  # asked every step: the switches apply live
            if step > 0:
                rt.decode_path, rt.decode_path_reason = path.label, reason
            logits = path.run(forward)
            cache = forward.kv  # the model's own cache class is made by its first forward
            picks = counters.take_token_picks()
            if step > 0 and picks is not None:
                routed.append(picks)
            token = sampler.next_token(logits)
            timeline.forward_done(decode=step > 0)
            if step == 0:
                timeline.first_token_out()
            if not reply.take(token):
                break
            sampler.accept(token)
            step_input = torch.tensor([[token]], dtype=torch.long, device=rt.device)
        counters.keep_token_picks = False
        return routed

    def _denoise_blocks(self, ids: torch.Tensor, settings: SamplingSettings, reply: _Reply,
                        timeline: _Timeline, on_draft: TextFn | None) -> list[np.ndarray]:
        """A block-diffusion model's own loop (engine.decode.block_diffusion): each denoising forward is
        one step for the counters, and its draft of the block (the most likely token at each place, up
        to the reply's length limit) goes to `on_draft`; each finished block enters the reply token by
        token. No per-token routing to return: a block's forwards route a whole canvas at a time."""
        rt = self.runtime
        rt.decode_path, rt.decode_path_reason = block_diffusion.LABEL, block_diffusion.REASON
        blocks = 0

        def on_step(draft: torch.Tensor) -> bool:
            timeline.forward_done(decode=blocks > 0)
            if on_draft is not None and rt.tokenizer is not None:
                on_draft(rt.tokenizer.decode(draft[0, : reply.limit - len(reply.tokens)].tolist(),
                                             skip_special_tokens=True))
            return reply.interrupted()

        def on_block() -> None:
            nonlocal blocks
            if blocks == 0:
                timeline.first_token_out(whole_blocks=True)
            blocks += 1

        streamer = block_diffusion.BlockStreamer(on_step, reply.take, on_block)
        block_diffusion.denoise(rt.model, ids, block_diffusion.seed_for(settings.temperature, settings.seed),
                                reply.limit, streamer)
        return []


class _Reply:
    """The reply so far, taken a token at a time: stop tokens, text deltas, stop strings, the length
    limit and cancellation, for either loop."""

    def __init__(self, tokenizer, eos: set[int], stop: Sequence[str], limit: int, on_text: TextFn | None,
                 on_token: TokenFn | None, between_tokens: Callable[[], bool] | None) -> None:
        self.tokenizer, self.eos, self.stop, self.limit = tokenizer, eos, stop, limit
        self.on_text, self.on_token, self.between_tokens = on_text, on_token, between_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.finish = "length"  # "eos" | "length" | "stop" | "cancelled"

    def take(self, token: int) -> bool:
        """Add `token`; False when the reply is over (`finish` says why)."""
        self.tokens.append(token)  # an EOS is part of the ids (as transformers returns it), not of the text
        if token in self.eos:
            self.finish = "eos"
            return False
        if self.on_token:
            self.on_token(token)
        if self.tokenizer is not None:
            delta, stopped = self._advance_text()
            if delta and self.on_text:
                self.on_text(delta)
            if stopped:
                self.finish = "stop"
                return False
        return not self.interrupted() and len(self.tokens) < self.limit

    def _advance_text(self) -> tuple[str, bool]:
        """Decode the reply so far into `text`; return (the new delta, hit a stop string)."""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return "", False  # a multi-byte character is incomplete; wait for its next token
        stopped = False
        for s in self.stop:
            at = full.find(s)
            if s and at >= 0:
                full, stopped = full[:at], True
                break
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta, stopped

    def interrupted(self) -> bool:
        """Apply what arrived meanwhile (the caller's `between_tokens`); True when it asks to stop."""
        if self.between_tokens is not None and self.between_tokens():
            self.finish = "cancelled"
            return True
        return False


class _Timeline:
    """When the reply's first token came and what the cache did before and after it."""

    def __init__(self, runtime: MoERuntime) -> None:
        self.runtime = runtime
        self.counters = counters = runtime.counters
        self.bytes_at_start = self.bytes_at_first = counters.bytes_ondemand + counters.bytes_prefetch
        self.stall_at_start = counters.stall_s
        self.t0 = self.t_first = time.perf_counter()
        self.decode_hits = self.decode_misses = 0
        self.whole_blocks = False

    def forward_done(self, decode: bool) -> None:
        """A forward ended: one step for the counters and the policy (live: it may change mid-reply), its
        hits counted as decode's if `decode`."""
        record = self.counters.end_token()
        self.runtime.cache.policy.on_token_end()
        if decode:
            self.decode_hits += record.hits
            self.decode_misses += record.misses

    def first_token_out(self, whole_blocks: bool = False) -> None:
        """The first token is out. `whole_blocks`: it came with a whole block, whose tokens were all
        written in the time to it, so the decode rate counts from the start."""
        self.t_first = time.perf_counter()
        self.bytes_at_first = self.counters.bytes_ondemand + self.counters.bytes_prefetch
        self.whole_blocks = whole_blocks

    def decode_rate(self, tokens: int, t_end: float) -> float:
        """Tokens per second after the first (one at a time), or over the whole reply (whole blocks)."""
        if self.whole_blocks:
            return tokens / max(t_end - self.t0, 1e-9)
        return (tokens - 1) / (t_end - self.t_first) if tokens > 1 else 0.0


def _stack_routing(rows: list[np.ndarray], layers: int) -> np.ndarray:
    """[steps, layers, top_k] int16 from per-step picks (widths can differ: pad with -1)."""
    width = max((r.shape[1] for r in rows), default=0)
    out = np.full((len(rows), layers, width), -1, dtype=np.int16)
    for i, r in enumerate(rows):
        out[i, :, : r.shape[1]] = r
    return out
