"""Routing traces: what `moescope generate/chat --trace FILE` records and `moescope trace replay` reads.

MoEScope writes JSON lines. The first line is a header:

    {"format": "moescope-trace", "version": 1, "model": ..., "fingerprint": ..., "num_layers": L,
     "num_experts": E, "top_k": k, "expert_bytes": B, "predict_window": 3}

then one line per MoE layer per forward step (a prefill is one step of many tokens):

    {"r": request, "t": first token position, "n": tokens, "l": MoE layer,
     "e": [[experts of token 0], ...], "w": [[their routing weights], ...],
     "p": {"1": [...], "2": [...], "3": [...]}}

`p[d]` are the experts layer l+d's router picks on layer l's hidden state (what ProMoE-style
prediction would have guessed), so the predicting policies can be replayed. Other tools can
write a plain CSV instead (`read_trace` tells them apart by the first character):

    request,token,layer,experts
    0,0,0,3 17
    0,0,1,5 2

one row per token and layer, experts space-separated; its geometry comes from the caller.

A third shape, one JSON object per decode token with every layer's expert set and no header,

    {"tok": 1, "layers": [[6, 8, 15, ...], [7, 16, ...], ...]}

is how the real OLMoE-1B-7B trace of the public repository sqliteai/warp is written
(`tests/trace_olmoe_299.jsonl`, Apache-2.0; the project keeps a copy in `../shared/traces/olmoe-1b-7b/`):
one request, decode steps only, layer count from the lines, expert count from the caller.

`Trace.split` cuts a trace in two for honest replay: the first part calibrates (profiles, miss
curves, every policy's warm-up), only the rest is scored.
This module is numpy-only (the writer takes tensors but never imports torch).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

FORMAT = "moescope-trace"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and the line."""


@dataclass
class TraceStep:
    request: int
    token: int  # first token position of the step
    tokens: int  # tokens in the step (1 when decoding)
    layer: int
    experts: list[int]  # sorted, unique
    counts: list[int]  # tokens routed to each of `experts`
    mass: list[float]  # summed routing weight of each of `experts`
    predictions: dict[int, list[int]] = field(default_factory=dict)  # target layer -> experts
    last: list[int] | None = None  # a many-token step's last token's experts (None: one token)


@dataclass
class Trace:
    num_layers: int
    num_experts: int
    top_k: int
    steps: list[TraceStep]
    expert_bytes: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.steps if s.layer == 0)

    @property
    def requests(self) -> int:
        return len({s.request for s in self.steps})

    def activation_counts(self) -> np.ndarray:
        """[layers, experts] routing counts: a popularity profile built from this trace."""
        counts = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for s in self.steps:
            counts[s.layer, s.experts] += s.counts
        return counts

    def split(self, fraction: float) -> tuple[Trace, Trace]:
        """(first part, rest): the first `fraction` of the requests, or of the forward steps when the
        trace holds one request. Whole requests, so a request's own routing never calibrates itself."""
        if not 0 <= fraction < 1:
            raise ValueError(f"the calibration share must be at least 0 % and below 100 %, got {fraction:.0%}")
        keys = [s.request for s in self.steps] if self.requests > 1 else [(s.request, s.token) for s in self.steps]
        order = list(dict.fromkeys(keys))
        cut = set(order[: round(len(order) * fraction)])
        head = [s for s, key in zip(self.steps, keys, strict=True) if key in cut]
        tail = [s for s, key in zip(self.steps, keys, strict=True) if key not in cut]
        return self._with(head, "calibration"), self._with(tail, "scored")

    def _with(self, steps: list[TraceStep], part: str) -> Trace:
        return Trace(self.num_layers, self.num_experts, self.top_k, steps, self.expert_bytes, self.meta | {"part": part})


# ---------------------------------------------------------------- writing


class TraceWriter:
    """Appends the engine's routing to a JSON-lines trace; request ids come from the engine's counters."""

    def __init__(self, path: str | Path, header: dict, request_index) -> None:
        self.path = Path(path)
        self._file: TextIO = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write(json.dumps({"format": FORMAT, "version": 1, **header}) + "\n")
        self._request_index = request_index  # () -> int that changes when a request starts
        self._seen = None
        self._request = -1  # renumbered 0, 1, 2, ... in the file
        self._position = 0
        self._last_tokens = 0

    def record(self, layer: int, index, weights, predictions: dict[int, list[int]]) -> None:
        """One MoE layer's routing for one forward step (index/weights: [tokens, top_k] tensors)."""
        if layer == 0:
            seen = self._request_index()
            if seen != self._seen:
                self._seen, self._request, self._position = seen, self._request + 1, 0
            else:
                self._position += self._last_tokens
            self._last_tokens = int(index.shape[0])
        line = {
            "r": self._request, "t": self._position, "n": int(index.shape[0]), "l": layer,
            "e": index.tolist(), "w": [[round(float(x), 5) for x in row] for row in weights.float().tolist()],
        }
        if predictions:
            line["p"] = {str(t - layer): experts for t, experts in predictions.items()}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# ---------------------------------------------------------------- reading


def read_trace(
    path: str | Path, *, num_layers: int | None = None, num_experts: int | None = None, top_k: int | None = None
) -> Trace:
    """Read a MoEScope JSON-lines trace, a per-token layer-lists trace (the OLMoE shape) with the expert
    count given, or a CSV (`request,token,layer,experts`) with the geometry given."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as handle:
            first = handle.readline()
            handle.seek(0)
            if first.startswith("{"):
                if '"layers"' in first and '"format"' not in first:
                    return _read_token_lines(path, handle, num_experts)
                return _read_jsonl(path, handle)
            return _read_csv(path, handle, num_layers, num_experts, top_k)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def _read_jsonl(path: Path, handle: TextIO) -> Trace:
    lines = iter(enumerate(handle, start=1))
    header = _json_line(path, *next(lines))
    if header.get("format") != FORMAT:
        raise TraceError(f"{path}: line 1 is not a MoEScope trace header")
    try:
        geometry = int(header["num_layers"]), int(header["num_experts"]), int(header["top_k"])
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{path}: the header needs num_layers, num_experts and top_k") from None
    steps = []
    for number, text in lines:
        if not text.strip():
            continue
        rec = _json_line(path, number, text)
        try:
            per_token = [list(map(int, row)) for row in rec["e"]]
            weights = [list(map(float, row)) for row in rec.get("w") or [[1.0] * len(r) for r in per_token]]
            preds = {int(rec["l"]) + int(d): sorted(map(int, v)) for d, v in (rec.get("p") or {}).items()}
            steps.append(_step(int(rec["r"]), int(rec["t"]), int(rec["l"]), per_token, weights, preds))
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{path}: line {number} is not a routing record (needs r, t, l, e)") from None
        _check(path, number, steps[-1], *geometry)
    return Trace(*geometry, steps, header.get("expert_bytes"), header)


def _read_token_lines(path: Path, handle: TextIO, num_experts: int | None) -> Trace:
    """`{"tok": n, "layers": [[experts of layer 0], ...]}` per decode token: the shape of the OLMoE-1B-7B
    trace from sqliteai/warp (`tests/trace_olmoe_299.jsonl`, Apache-2.0). Without `num_experts` the count
    comes from the ids (the highest + 1, over every layer), and `meta["note"]` says so."""
    steps: list[TraceStep] = []
    bound = num_experts if num_experts is not None else 2**31  # ids are checked against the count at the end
    num_layers = top_k = 0
    for number, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        rec = _json_line(path, number, text)
        try:
            layers = [[int(e) for e in experts] for experts in rec["layers"]]
            token = int(rec.get("tok", number)) - 1  # positions from 0, as the engine's traces
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{path}: line {number} is not a token's routing (needs \"layers\": [[...], ...])") from None
        num_layers = num_layers or len(layers)
        if len(layers) != num_layers:
            raise TraceError(f"{path}: line {number} has {len(layers)} layers, line 1 has {num_layers}")
        for layer, experts in enumerate(layers):
            top_k = max(top_k, len(experts))
            steps.append(_step(0, token, layer, [experts], [[1.0 / max(1, len(experts))] * len(experts)], {}))
            _check(path, number, steps[-1], num_layers, bound, None)
    if not steps:
        raise TraceError(f"{path} holds no routing")
    meta: dict = {"format": "token-lines"}
    if num_experts is None:  # the file has no header: the ids bound the count from below
        highest = max((s.experts[-1] for s in steps if s.experts), default=0)
        num_experts = highest + 1
        meta["note"] = (f"{path.name} has no header: {num_experts} experts per layer, from its highest expert id "
                        f"({highest}); --num-experts N says otherwise")
    return Trace(num_layers, num_experts, top_k, steps, None, meta)


def _json_line(path: Path, number: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise TraceError(f"{path}: line {number} is not valid JSON") from None
    if not isinstance(value, dict):
        raise TraceError(f"{path}: line {number} is not a JSON object")
    return value


def _read_csv(path: Path, handle: TextIO, num_layers: int | None, num_experts: int | None, top_k: int | None) -> Trace:
    if num_layers is None or num_experts is None:
        raise TraceError(f"{path} is a CSV trace: give --num-layers and --num-experts")
    reader = csv.reader(handle)
    head = [h.strip().lower() for h in next(reader, [])]
    if head[:4] != ["request", "token", "layer", "experts"]:
        raise TraceError(f"{path}: a CSV trace starts with the header request,token,layer,experts")
    steps = []
    for number, row in enumerate(reader, start=2):
        if not row or not "".join(row).strip():
            continue
        try:
            request, token, layer = int(row[0]), int(row[1]), int(row[2])
            experts = [int(x) for x in row[3].split()]
        except (IndexError, ValueError):
            raise TraceError(f"{path}: line {number} is not 'request,token,layer,experts'") from None
        steps.append(_step(request, token, layer, [experts], [[1.0 / max(1, len(experts))] * len(experts)], {}))
        _check(path, number, steps[-1], num_layers, num_experts, top_k)
    k = top_k or max((len(s.experts) for s in steps), default=1)
    return Trace(num_layers, num_experts, k, steps, None, {"format": "csv"})


def _step(request: int, token: int, layer: int, per_token: list[list[int]], weights: list[list[float]],
          predictions: dict[int, list[int]]) -> TraceStep:
    counts: dict[int, int] = {}
    mass: dict[int, float] = {}
    for row, wrow in zip(per_token, weights, strict=True):
        for e, w in zip(row, wrow, strict=True):
            counts[e] = counts.get(e, 0) + 1
            mass[e] = mass.get(e, 0.0) + w
    experts = sorted(counts)
    last = sorted(set(per_token[-1])) if len(per_token) > 1 else None
    return TraceStep(request, token, len(per_token), layer, experts, [counts[e] for e in experts],
                     [mass[e] for e in experts], predictions, last)


def _check(path: Path, number: int, step: TraceStep, num_layers: int, num_experts: int, top_k: int | None) -> None:
    if not 0 <= step.layer < num_layers:
        raise TraceError(f"{path}: line {number} has layer {step.layer}, but the trace has {num_layers} layers")
    if step.experts and not (step.experts[0] >= 0 and step.experts[-1] < num_experts):
        raise TraceError(f"{path}: line {number} names an expert outside 0..{num_experts - 1}")


def steps_by_boundary(trace: Trace) -> Iterator[tuple[bool, bool, TraceStep]]:
    """Each step with (starts a new forward step, starts a new request), in file order."""
    previous: tuple[int, int] | None = None
    for step in trace.steps:
        key = (step.request, step.token)
        yield key != previous, previous is None or step.request != previous[0], step
        previous = key
