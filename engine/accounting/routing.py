"""One forward step's routing, as every bookkeeper records it (numpy only).

The per-layer path records one MoE layer of a step at a time (a prefill, or a decode token run
layer by layer); the whole-token step records every layer of a decode token at once. Both hand
the same `RoutingStep` to the same code (directory, policy, counters, miss curves), so the two
paths cannot drift apart: one layer is simply a step with one row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingStep:
    """For each of `layers` (ascending MoE layer indices), the sorted, distinct experts it needed."""

    layers: np.ndarray  # [rows] int64
    experts: np.ndarray  # [rows, width] int64, each row sorted and distinct
    counts: np.ndarray  # [rows, width] int64: tokens routed to each of those experts
    tokens: int = 1  # tokens in this step (a prefill has many)
    # A many-token step's last token: the experts it picked, [1, k] sorted (one layer), or None. The
    # next token follows this one, not the whole prompt: it is the most recent use.
    last: np.ndarray | None = None

    @classmethod
    def of_layer(cls, layer: int, experts: Sequence[int], counts: Sequence[int] | None = None,
                 tokens: int = 1, last: Sequence[int] | None = None) -> RoutingStep:
        """One layer's needs: `experts` sorted and distinct, `counts` tokens each (None: one each);
        `last`: the experts of a many-token step's last token (those of them among `experts`)."""
        ids = np.asarray(experts, dtype=np.int64)[None, :]
        each = np.ones_like(ids) if counts is None else np.asarray(counts, dtype=np.int64)[None, :]
        final = None
        if last is not None and tokens > 1:
            final = np.asarray(sorted(set(map(int, last)).intersection(map(int, experts))), dtype=np.int64)[None, :]
        return cls(np.array([layer], dtype=np.int64), ids, each, tokens, final)

    @classmethod
    def of_token(cls, picks: np.ndarray) -> RoutingStep:
        """A decode token: `picks[layer]` are the (distinct) experts each layer ran, in any order."""
        ids = np.sort(np.asarray(picks, dtype=np.int64), axis=1)
        return cls(np.arange(ids.shape[0], dtype=np.int64), ids, np.ones_like(ids), 1)

    @property
    def single_layer(self) -> int | None:
        return int(self.layers[0]) if len(self.layers) == 1 else None

    def rows(self) -> Iterator[tuple[int, list[int], list[int]]]:
        """(layer, experts, counts) per row, as plain lists."""
        yield from zip(self.layers.tolist(), self.experts.tolist(), self.counts.tolist(), strict=True)


def picks_and_distinct(experts: np.ndarray) -> tuple[int, int]:
    """[rows, n] expert ids, -1 for none (a row a layer; the picks of several tokens side by side): how
    many picks there are, and how many distinct experts, each row's counted apart and summed."""
    ordered = np.sort(experts, axis=1)
    first = np.ones(ordered.shape, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    picked = ordered >= 0
    return int(picked.sum()), int((first & picked).sum())
