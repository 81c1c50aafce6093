"""The replies the engine decodes at once: continuous batching, in turns.

Up to `parallel` replies are open together (the window's chat may join as one more, so it never
waits behind the server's clients). A turn advances every open reply by one forward: a chunk of
its prompt (those first), or one token. New replies join between turns, finished and cancelled ones leave, and
each keeps its own KV cache, sampling, stop strings and figures (engine.decode.sequence), so a
reply's tokens are the ones it would get alone. One-token forwards on a path that runs them together
do (`DecodePath.run_together`: one native step for all of them, or their layers gathered by
engine.decode.layer_gather): the weights they share are read, and the experts loaded, once a turn.
With `pack_prompts`, new replies' prompts go with them where their path runs them together: short
prompts on the whole-token path as rows of the same native step as the others' tokens (each bit for
bit its own), longer ones on the fast prompt path in one forward, at most one chunk's tokens
(engine.decode.paths.packed_prompts: each prompt to that path's reference, not bit for bit its
forward alone). `BatchSharing` counts how many picks the turns' experts had.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine import protocol as p
from engine.accounting.counters import TokenRecord
from engine.accounting.routing import picks_and_distinct

if TYPE_CHECKING:  # the worker imports this before torch (it starts and answers before any model loads)
    from engine.decode.sequence import Sequence
    from engine.process.telemetry import ReplyClock


@dataclass
class Stream:
    """One open reply: its request, its sequence and the clock the telemetry reads."""

    request_id: str
    sequence: Sequence
    clock: ReplyClock

    def info(self) -> p.StreamInfo:
        state = "prefill" if self.sequence.prefilling else "decoding"
        return p.StreamInfo(self.request_id, state, self.sequence.prompt_tokens, self.clock.tokens,
                            self.clock.decode_tokens_per_s)


class _Sharing:
    """Expert picks per turn, summed over the turns with two replies or more."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.reset()

    def reset(self) -> None:
        self.turns = self.uses = self.distinct = self.streams = 0

    def add_turn(self, picks: list[np.ndarray], streams: int) -> None:
        """`picks`: the [layers, top_k] experts of this turn's replies that ran alone (-1 pads);
        `streams`: how many replies the turn ran in all."""
        self.streams = streams
        if len(picks) >= 2:
            self.add(*picks_and_distinct(np.concatenate(picks, axis=1)))

    def add(self, uses: int, distinct: int) -> None:
        """A turn's picks and distinct experts (for a gathered run, as counted there)."""
        self.turns += 1
        self.uses += uses
        self.distinct += distinct

    def snapshot(self) -> p.BatchSharing | None:
        if not self.turns:
            return None
        return p.BatchSharing(self.streams, self.turns, self.uses, self.distinct, self.layers)


class Batch:
    def __init__(self, parallel: int, layers: int, together: bool = False, end_token: Callable | None = None,
                 pack_prompts: bool = False) -> None:
        self.parallel = max(1, parallel)
        self.streams: list[Stream] = []
        self.sharing = _Sharing(layers)
        self.together = together  # one-token forwards on a path that runs them together do (else each alone)
        self.pack_prompts = pack_prompts  # and new replies' prompts, where their path packs them
        self._end_token = end_token  # the counters' end of a step (a run together is one, shared out)

    def __bool__(self) -> bool:
        return bool(self.streams)

    def has_room(self, request_id: str) -> bool:
        """The server's requests wait for a free place; the window's chat takes one more if it must."""
        limit = self.parallel if p.is_api_request(request_id) else self.parallel + 1
        return len(self.streams) < limit

    def add(self, stream: Stream) -> None:
        if not self.streams:
            self.sharing.reset()
        stream.sequence.watch_picks = True
        self.streams.append(stream)

    def cancel(self, request_id: str | None) -> None:
        """Cancel one open reply (None: all of them); it leaves at the end of the turn."""
        for stream in self.streams:
            if request_id is None or stream.request_id == request_id:
                stream.sequence.cancel()

    def turn(self, on_done: Callable[[Stream], None], on_error: Callable[[Stream, Exception], None]) -> None:
        """One forward of every open reply: those still reading their prompt first (a new request's
        first token waits for no other reply's token: it runs before them, or in the same step),
        then the others, oldest first; forwards on a path that runs them together do (`together`,
        `pack_prompts`). The finished ones leave through
        `on_done`, one that fails through `on_error` (the others go on)."""
        self._on_done, self._on_error = on_done, on_error
        streams = len(self.streams)
        picks: list[np.ndarray] = []
        for group in self._groups():
            if len(group) > 1:
                self._run_gathered(group)
                continue
            stream, path, forward = group[0]
            stream.sequence.watch_routing()
            ran = self._attempt(stream, lambda p=path, f=forward: p.run(f), forward)
            if ran and stream.sequence.last_picks is not None:
                picks.append(stream.sequence.last_picks)
        self.sharing.add_turn(picks, streams)

    def _groups(self) -> list[list[tuple[Stream, object, object]]]:
        """The turn's forwards in order, those a path can run together in one group per path."""
        groups: list[list] = []
        together: dict[int, list] = {}
        for stream in sorted(self.streams, key=lambda s: not s.sequence.prefilling):
            if stream.sequence.finished:  # cancelled since the last turn
                self._leave(stream)
                self._on_done(stream)
                continue
            try:
                path, forward = stream.sequence.prepare()
            except Exception as exc:
                self._leave(stream)
                self._on_error(stream, exc)
                continue
            if self._joins(path, forward):
                group = together.get(id(path))
                if group is None or (forward.prefill and _tokens(group) + forward.input_ids.shape[1]
                                     > stream.sequence.chunk_tokens):  # a packed prompt stays within a chunk
                    group = together[id(path)] = []
                    groups.append(group)
                group.append((stream, path, forward))
            else:
                groups.append([(stream, path, forward)])
        return groups

    def _joins(self, path, forward) -> bool:
        """The forward runs with others of its path (`run_together`)."""
        wanted = self.pack_prompts if forward.prefill else self.together
        return wanted and path.can_run_together(forward)

    def _run_gathered(self, group: list) -> None:
        """Forwards of several replies run together by their path."""
        path = group[0][1]
        try:
            together = path.run_together([forward for _, _, forward in group])
        except Exception as exc:
            for stream, _, _ in group:
                self._leave(stream)
                self._on_error(stream, exc)
            return
        if together.uses:
            self.sharing.add(together.uses, together.distinct)
        shares = split_record(self._end_token(), len(group))
        for (stream, _, forward), out, share, picks in zip(group, together.logits, shares, together.picks, strict=True):
            self._attempt(stream, lambda o=out: o, forward, share, picks)

    def _attempt(self, stream: Stream, run: Callable, forward, record=None, picks=None) -> bool:
        """Run (or take) the forward's logits and finish its step; False when the reply left."""
        try:
            going = stream.sequence.finish(forward, run(), record, picks)
        except Exception as exc:
            self._leave(stream)
            self._on_error(stream, exc)
            return False
        if not going:
            self._leave(stream)
            self._on_done(stream)
        return going

    def _leave(self, stream: Stream) -> None:
        self.streams.remove(stream)
        stream.sequence.release()

    @property
    def state(self) -> str:
        return "decoding" if any(not s.sequence.prefilling for s in self.streams) else "prefill"


def _tokens(group: list) -> int:
    return sum(forward.input_ids.shape[1] for _, _, forward in group)


def split_record(record: TokenRecord, parts: int) -> list[TokenRecord]:
    """A gathered run's cache record shared out evenly between its `parts` replies (the remainder to the first)."""
    def share(total: int, index: int) -> int:
        return total // parts + (total % parts if index == 0 else 0)

    return [TokenRecord(share(record.hits, i), share(record.misses, i), share(record.bytes_loaded, i),
                        record.stall_s / parts) for i in range(parts)]
