"""The ways a forward step can run, behind one interface, and the chooser that asks them in order.

A decode path says why it cannot run a step in the current state (`unavailable`, None when it
can) and runs it (`run`, the logits of the last position). The generation loop asks the chooser
once per step; the first path that can run it does, and its label is what the System panel shows.
To add a path: implement `DecodePath` and put it in `MoERuntime`'s list, fastest first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache


@dataclass
class Step:
    """One forward step of the generation loop."""

    input_ids: torch.Tensor  # [1, n]: the prompt (prefill) or the last token (decode)
    kv: DynamicCache | None  # None until the first forward, for a model that makes its own cache
    position: int  # tokens already in the KV cache
    # every position's logits, not only the last (teacher-forced scoring of a prompt); prompt paths only
    every_position: bool = False
    token: int | None = None  # the last token as an int, where the caller has it (no device read)

    @property
    def prefill(self) -> bool:
        return self.position == 0 or self.input_ids.shape[1] > 1

    @property
    def last_token(self) -> int:
        return self.token if self.token is not None else int(self.input_ids[0, -1])


@dataclass
class Together:
    """Steps of several replies run at once (`DecodePath.run_together`)."""

    logits: list[torch.Tensor]  # per step, [1, 1, vocab]
    picks: list[np.ndarray | None]  # per step, its experts [MoE layers, top_k] in order of id (-1: none); None for prompts
    uses: int  # expert picks of the run's one-token steps, their layers summed (0 when it has none)
    distinct: int  # distinct experts those steps computed, their layers summed (0 when it has none)


class DecodePath(ABC):
    label: str  # how a decode token ran, for the user: "exact: transformers' kernels", ...

    @abstractmethod
    def unavailable(self, step: Step) -> str | None:
        """Why this path cannot run `step` now, in words for the user; None when it can."""

    @abstractmethod
    def run(self, step: Step) -> torch.Tensor:
        """Run the step; the logits of its last position, [1, 1, vocab] (of every position, [1, n, vocab],
        when the step asks: only prompt paths are asked)."""

    def can_run_together(self, step: Step) -> bool:
        """Whether `step` (one this path can run) may run with other replies' steps of its kind in one
        `run_together`."""
        return False

    def run_together(self, steps: list[Step]) -> Together:
        """Steps of several replies that `can_run_together`, at once: one-token steps each get the
        logits and experts they get alone, the experts they share computed once; prompts each get
        their logits to the path's reference (the whole-token path's: bit for bit their own)."""
        raise NotImplementedError


class PathChooser:
    """Asks the paths in order (fastest first); the last one must always be able to run."""

    def __init__(self, paths: list[DecodePath]) -> None:
        self.paths = paths

    def choose(self, step: Step) -> tuple[DecodePath, str]:
        """The first path that can run `step`, and why the fastest one could not ("" if it ran): a
        later refusal may only say that a prompt path does not take one-token steps."""
        reason = ""
        for path in self.paths:
            why = path.unavailable(step)
            if why is None:
                return path, reason
            reason = reason or why
        raise RuntimeError(f"no decode path can run this step: {reason}")
