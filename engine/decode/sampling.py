"""Choosing the next token: greedy, or sampling with the usual knobs, in transformers' order."""

from __future__ import annotations

import numpy as np
import torch

from engine.protocol import SamplingSettings


class Sampler:
    def __init__(self, settings: SamplingSettings, device: torch.device) -> None:
        self.settings = settings
        self.generator = None
        if not settings.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(settings.seed if settings.seed is not None else torch.seed())

    def next_token(self, logits: torch.Tensor, seen: torch.Tensor) -> int:
        """`logits`: [vocab] for the last position; `seen`: every token id so far (prompt + reply)."""
        s = self.settings
        logits = logits.float()
        if s.repetition_penalty != 1.0:
            # CTRL-style penalty, as transformers' RepetitionPenaltyLogitsProcessor applies it.
            picked = logits.gather(0, seen)
            picked = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
            logits = logits.scatter(0, seen, picked)
        if s.greedy:
            if logits.device.type == "cpu":  # numpy's argmax: same first-maximum (and NaN) rule, less dispatch
                return int(np.argmax(logits.numpy()))
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
