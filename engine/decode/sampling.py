"""Choosing the next token: greedy, or sampling with the usual knobs, in transformers' order."""

from __future__ import annotations

import numpy as np
import torch

from engine.protocol import SamplingSettings


class Sampler:
    """Picks each next token; remembers the ids so far where the repetition penalty needs them.

    Between decode tokens every torch or numpy call runs cold (the step's weight streams evict their
    code and data), so the greedy path keeps to three calls and the ids are only kept as a tensor,
    in a buffer written in place, when the penalty reads them."""

    def __init__(self, settings: SamplingSettings, device: torch.device, prompt: torch.Tensor) -> None:
        self.settings = settings
        self.generator = None
        if not settings.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(settings.seed if settings.seed is not None else torch.seed())
        self._seen: torch.Tensor | None = None  # every token id so far, for the repetition penalty
        self._count = 0
        if settings.repetition_penalty != 1.0:
            self._seen = torch.empty(max(64, 2 * prompt.numel()), dtype=torch.long, device=device)
            self._seen[: prompt.numel()] = prompt.reshape(-1)
            self._count = prompt.numel()

    def accept(self, token: int) -> None:
        """`token` joins the ids so far."""
        if self._seen is None:
            return
        if self._count == self._seen.numel():
            self._seen = torch.cat([self._seen, torch.empty_like(self._seen)])
        self._seen[self._count] = token
        self._count += 1

    def next_token(self, logits: torch.Tensor) -> int:
        """`logits`: [..., vocab]; the last row is the last position's."""
        s = self.settings
        logits = logits.float()
        if s.greedy and self._seen is None and logits.device.type == "cpu":
            # numpy's argmax: torch's first-maximum (and NaN) rule, with less dispatch
            rows = logits.numpy()
            return int(np.argmax(rows.reshape(-1, rows.shape[-1])[-1]))
        logits = logits.reshape(-1, logits.shape[-1])[-1]
        if self._seen is not None:
            # CTRL-style penalty, as transformers' RepetitionPenaltyLogitsProcessor applies it.
            seen = self._seen[: self._count]
            picked = logits.gather(0, seen)
            picked = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
            logits = logits.scatter(0, seen, picked)
        if s.greedy:
            return int(torch.argmax(logits))
        logits = logits / s.temperature
        if s.top_k > 0:
            kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=False)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop_sorted = cumulative <= 1 - s.top_p
            drop_sorted[-1] = False  # always keep the most likely token
            logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
