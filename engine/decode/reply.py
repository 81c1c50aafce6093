"""A reply as it is generated: its tokens and text (stop tokens, stop strings, the length limit,
cancellation) and its own figures (time to the first token, what the cache did for its forwards).

The figures are summed from the records of the reply's own forwards (`EngineCounters.end_token`),
not from process-wide counters, so replies that decode together each get their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from engine.accounting.counters import EngineCounters, TokenRecord
from engine.protocol import ReplyStats
from engine.system.memory import peak_rss_bytes

TextFn = Callable[[str], None]
TokenFn = Callable[[int], None]


class Reply:
    """The reply so far, taken a token at a time, for either loop."""

    def __init__(self, tokenizer, eos: set[int], stop: Sequence[str], limit: int, on_text: TextFn | None,
                 on_token: TokenFn | None, between_tokens: Callable[[], bool] | None) -> None:
        self.tokenizer, self.eos, self.stop, self.limit = tokenizer, eos, stop, limit
        self.on_text, self.on_token, self.between_tokens = on_text, on_token, between_tokens
        self.tokens: list[int] = []
        self.text = ""
        # the detokenizer's window: tokens [_prefix, _read) are text already, kept as context
        self._prefix = self._read = 0
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
        """Extend `text` by the newest tokens; return (the new delta, hit a stop string).

        Only a window is decoded, as vLLM's and TGI's detokenizers do: the tokens from `_prefix` on,
        whose text up to `_read` is out already. Its first tokens are context for tokenizers whose
        text of a token depends on the one before (a leading space dropped at the start, the bytes
        of one character over two tokens). So a token costs the same however long the reply is: a
        decode of the whole reply per token made long replies quadratic."""
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if window.endswith("\ufffd"):
            return "", False  # a multi-byte character is incomplete; wait for its next token
        if window.startswith(before):
            full = self.text + window[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        else:  # the context changed the text before (a cleanup of spaces): the whole reply again
            full = decode(self.tokens, skip_special_tokens=True)
        stopped = False
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s) + 1))  # found before, it would have stopped then
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

    def cancel(self) -> None:
        self.finish = "cancelled"


class ReplyTimeline:
    """When the reply's first token came, and what the cache did for its forwards before and after it."""

    def __init__(self) -> None:
        self.t0 = self.t_first = time.perf_counter()
        self.prompt = TokenRecord(0, 0, 0, 0.0)  # the forwards up to the first token
        self.decode = TokenRecord(0, 0, 0, 0.0)  # the forwards after it
        self.first_out = False
        self.whole_blocks = False

    def add(self, record: TokenRecord) -> None:
        """One of the reply's forwards ended; `record` is what the cache did for it."""
        part = self.decode if self.first_out else self.prompt
        part.hits += record.hits
        part.misses += record.misses
        part.bytes_loaded += record.bytes_loaded
        part.stall_s += record.stall_s

    def first_token_out(self, whole_blocks: bool = False) -> None:
        """The first token is out. `whole_blocks`: it came with a whole block, whose tokens were all
        written in the time to it, so the decode rate counts from the start."""
        self.t_first = time.perf_counter()
        self.first_out = True
        self.whole_blocks = whole_blocks

    def decode_rate(self, tokens: int, t_end: float) -> float:
        """Tokens per second after the first (one at a time), or over the whole reply (whole blocks)."""
        if self.whole_blocks:
            return tokens / max(t_end - self.t0, 1e-9)
        return (tokens - 1) / (t_end - self.t_first) if tokens > 1 else 0.0

    def stats(self, prompt_tokens: int, generated: int, budget_bytes: int) -> ReplyStats:
        t_end = time.perf_counter()
        p, d = self.prompt, self.decode
        ttft = (self.t_first if self.first_out else t_end) - self.t0
        return ReplyStats(
            prefill_tokens=prompt_tokens,
            decode_tokens=generated,
            ttft_s=ttft,
            prefill_tokens_per_s=prompt_tokens / max(ttft, 1e-9),
            decode_tokens_per_s=self.decode_rate(generated, t_end),
            hits=p.hits + d.hits,
            misses=p.misses + d.misses,
            hit_rate=EngineCounters.rate(p.hits + d.hits, p.misses + d.misses),
            decode_hit_rate=EngineCounters.rate(d.hits, d.misses),
            bytes_loaded=p.bytes_loaded + d.bytes_loaded,
            decode_bytes_loaded=d.bytes_loaded,
            stall_s=p.stall_s + d.stall_s,
            budget_bytes=budget_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            total_s=t_end - self.t0,
        )


def stack_routing(rows: list[np.ndarray], layers: int) -> np.ndarray:
    """[steps, layers, top_k] int16 from per-step picks (widths can differ: pad with -1)."""
    width = max((r.shape[1] for r in rows), default=0)
    out = np.full((len(rows), layers, width), -1, dtype=np.int16)
    for i, r in enumerate(rows):
        out[i, :, : r.shape[1]] = r
    return out
