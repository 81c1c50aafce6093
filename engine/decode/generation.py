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
        device = rt.device
        sampler = Sampler(settings, device)
        eos = self.eos_ids()
        counters = rt.counters
        counters.start_request()
        rt.cache.policy.on_request_start()
        stats_start = (counters.bytes_ondemand + counters.bytes_prefetch, counters.stall_s)
        bytes_at_first = stats_start[0]
        decode_hits = decode_misses = 0

        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        seen = ids[0].clone()
        cache = new_cache(rt.model)
        counters.keep_token_picks = keep_routing
        counters.take_token_picks()
        routed: list[np.ndarray] = []  # one [layers, top_k] per step after the prompt (a generated token fed back)
        generated: list[int] = []
        text = ""
        finish = "length"
        t0 = time.perf_counter()
        t_first = t0
        step_input = ids
        for step in range(max_new):
            forward = Step(step_input, cache, len(prompt_ids) + len(generated) - step_input.shape[1])
            path, reason = rt.paths.choose(forward)  # asked every step: the switches apply live
            if step > 0:
                rt.decode_path, rt.decode_path_reason = path.label, reason
            logits = path.run(forward)
            cache = forward.kv  # the model's own cache class is made by its first forward
            picks = counters.take_token_picks()
            if step > 0 and picks is not None:
                routed.append(picks)
            token = sampler.next_token(logits[0, -1], seen)
            record = counters.end_token()
            rt.cache.policy.on_token_end()
            if step == 0:
                t_first = time.perf_counter()
                bytes_at_first = counters.bytes_ondemand + counters.bytes_prefetch
            else:
                decode_hits += record.hits
                decode_misses += record.misses
            generated.append(token)  # an EOS is part of the ids (as transformers returns it), not of the text
            if token in eos:
                finish = "eos"
                break
            if on_token:
                on_token(token)
            seen = torch.cat([seen, torch.tensor([token], device=device)])
            step_input = torch.tensor([[token]], dtype=torch.long, device=device)
            if rt.tokenizer is not None:
                text, delta, stopped = self._advance_text(generated, text, settings.stop)
                if delta and on_text:
                    on_text(delta)
                if stopped:
                    finish = "stop"
                    break
            if between_tokens is not None and between_tokens():
                finish = "cancelled"
                break
        t_end = time.perf_counter()
        counters.keep_token_picks = False

        stats = ReplyStats(
            prefill_tokens=len(prompt_ids),
            decode_tokens=len(generated),
            ttft_s=t_first - t0,
            prefill_tokens_per_s=len(prompt_ids) / max(t_first - t0, 1e-9),
            decode_tokens_per_s=(len(generated) - 1) / (t_end - t_first) if len(generated) > 1 else 0.0,
            hits=int(counters.request_layer_hits.sum()),
            misses=int(counters.request_layer_misses.sum()),
            bytes_loaded=counters.bytes_ondemand + counters.bytes_prefetch - stats_start[0],
            decode_bytes_loaded=counters.bytes_ondemand + counters.bytes_prefetch - bytes_at_first,
            stall_s=counters.stall_s - stats_start[1],
            budget_bytes=rt.cache.budget_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            total_s=t_end - t0,
        )
        stats.hit_rate = counters.rate(stats.hits, stats.misses)
        stats.decode_hit_rate = counters.rate(decode_hits, decode_misses)
        routing = _stack_routing(routed, rt.counters.num_layers) if keep_routing else None
        return GenerationResult(generated, text, finish, stats, routing)

    def _advance_text(self, generated: list[int], text: str, stop: Sequence[str]) -> tuple[str, str, bool]:
        """Decode the reply so far; return (text, new delta, hit a stop string)."""
        full = self.runtime.tokenizer.decode(generated, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return text, "", False  # a multi-byte character is incomplete; wait for its next token
        for s in stop:
            at = full.find(s)
            if s and at >= 0:
                full = full[:at]
                return full, full[len(text):] if full.startswith(text) else "", True
        delta = full[len(text):] if full.startswith(text) else ""
        return full, delta, False


def _stack_routing(rows: list[np.ndarray], layers: int) -> np.ndarray:
    """[steps, layers, top_k] int16 from per-step picks (widths can differ: pad with -1)."""
    width = max((r.shape[1] for r in rows), default=0)
    out = np.full((len(rows), layers, width), -1, dtype=np.int16)
    for i, r in enumerate(rows):
        out[i, :, : r.shape[1]] = r
    return out
