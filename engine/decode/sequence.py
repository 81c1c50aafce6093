"""One reply generated a forward at a time: its prompt in bounded chunks, then one token per step.

`Sequence.step` runs one forward (a chunk of the prompt, or the last token) through the decode
paths and returns whether the reply goes on. A sequence owns everything a reply needs (its KV
cache, sampler, stop strings, cancel, figures), so the engine can advance several in turn
(engine.process.batch) or one alone (Generator.generate): each computes exactly what it would alone.

The prompt goes in chunks of at most `chunk_tokens`, so its activations, router outputs and
attention scores never exceed one chunk's however long the prompt is (llama.cpp's micro-batch
does the same); the KV cache holds every position either way.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Ids

import numpy as np
import torch

from engine.accounting.counters import TokenRecord
from engine.decode.kv_cache import expect_positions, new_cache
from engine.decode.paths.base import DecodePath, Step
from engine.decode.reply import Reply, ReplyTimeline, TextFn, TokenFn, stack_routing
from engine.decode.sampling import Sampler
from engine.errors import MoEScopeError, PromptTooLongError
from engine.protocol import ReplyStats, SamplingSettings

# prompt tokens per forward: the prompt's working set is bounded by one chunk's
PREFILL_CHUNK_TOKENS = 512


def check_prompt(prompt_ids: Ids[int], settings: SamplingSettings, context: int) -> None:
    """Refuse, with one line, a request that cannot run: bad settings, no prompt, no room for a reply."""
    if problem := settings.problem():
        raise MoEScopeError(f"{problem.field} {problem.message}")
    if not prompt_ids:
        raise MoEScopeError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise PromptTooLongError(
            f"the prompt is {len(prompt_ids)} tokens but this model's context is {context} tokens; shorten it"
        )


class Sequence:
    def __init__(self, runtime, prompt_ids: Ids[int], settings: SamplingSettings, eos: set[int], *,
                 on_text: TextFn | None = None, on_token: TokenFn | None = None,
                 between_tokens: Callable[[], bool] | None = None, keep_routing: bool = False,
                 chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> None:
        check_prompt(prompt_ids, settings, runtime.context_length)
        self.runtime = runtime
        max_new = min(settings.max_new_tokens, runtime.context_length - len(prompt_ids))
        self.reply = Reply(runtime.tokenizer, eos, settings.stop, max_new, on_text, on_token, between_tokens)
        self.timeline = ReplyTimeline()
        self.prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=runtime.device)
        self.sampler = Sampler(settings, runtime.device, self.prompt[0])
        self.chunk_tokens = max(1, chunk_tokens)
        self.keep_routing = keep_routing
        self.kv = new_cache(runtime.model)
        expect_positions(self.kv, self.prompt_tokens)
        self.fed = 0  # positions in the KV cache
        self.token: int | None = None  # the last token out, the next step's input
        self.routed: list[np.ndarray] = []  # one [layers, top_k] per generated token fed back
        self.watch_picks = False  # keep each decode step's experts in `last_picks` (a batch counts their overlap)
        self.last_picks: np.ndarray | None = None
        self.finished = False

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.shape[1]

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_tokens

    def step(self) -> bool:
        """One forward: the next chunk of the prompt, or the last token. False when the reply is over."""
        if self.finished:
            return False
        path, forward = self.prepare()
        self.watch_routing()
        return self.finish(forward, path.run(forward))

    def prepare(self) -> tuple[DecodePath, Step]:
        """The next forward and the path that runs it (asked every step: the switches apply live).
        The caller runs it, alone (`step`) or gathered with others' (engine.process.batch), then
        hands its logits to `finish`."""
        rt = self.runtime
        forward = self._next_forward()
        path, reason = rt.paths.choose(forward)
        if not self.prefilling:
            rt.decode_path, rt.decode_path_reason = path.label, reason
        return path, forward

    def watch_routing(self) -> None:
        """Right before this sequence's forward runs alone: keep its experts where asked."""
        counters = self.runtime.counters
        counters.keep_token_picks = self.keep_routing or self.watch_picks
        counters.take_token_picks()

    def finish(self, forward: Step, logits: torch.Tensor, record: TokenRecord | None = None,
               picks: np.ndarray | None = None) -> bool:
        """The forward ran: count it (`record`, `picks`: its share of a gathered run's, else the
        counters' own), then sample; False when the reply is over."""
        rt, counters = self.runtime, self.runtime.counters
        decoding = not self.prefilling
        self.kv = forward.kv  # the model's own cache class is made by its first forward
        self.fed += forward.input_ids.shape[1]
        if picks is None:
            picks = counters.take_token_picks()
            counters.keep_token_picks = False
        self.last_picks = picks if decoding else None
        if decoding and picks is not None and self.keep_routing:
            self.routed.append(picks)
        self.timeline.add(record if record is not None else counters.end_token())
        rt.cache.policy.on_token_end()
        if self.prefilling:
            return not self._stop_if(self.reply.interrupted())
        return self._take(self.sampler.next_token(logits))

    def _next_forward(self) -> Step:
        if self.prefilling:
            end = min(self.fed + self.chunk_tokens, self.prompt_tokens)
            return Step(self.prompt[:, self.fed:end], self.kv, self.fed)
        ids = torch.tensor([[self.token]], dtype=torch.long, device=self.runtime.device)
        return Step(ids, self.kv, self.fed, token=self.token)

    def _take(self, token: int) -> bool:
        if not self.timeline.first_out:
            self.timeline.first_token_out()
        self.token = token
        if not self.reply.take(token):
            return not self._stop_if(True)
        self.sampler.accept(token)
        return True

    def _stop_if(self, stop: bool) -> bool:
        self.finished = self.finished or stop
        return stop

    def cancel(self) -> None:
        """Stop before the next forward (another sequence's request, a Cancel for this one)."""
        if not self.finished:
            self.reply.cancel()
            self.finished = True

    def release(self) -> None:
        """Drop the KV cache now (the sequence object may live on in a result)."""
        self.kv = None

    def stats(self) -> ReplyStats:
        return self.timeline.stats(self.prompt_tokens, len(self.reply.tokens), self.runtime.cache.budget_bytes)

    def routing(self) -> np.ndarray | None:
        return stack_routing(self.routed, self.runtime.counters.num_layers) if self.keep_routing else None
