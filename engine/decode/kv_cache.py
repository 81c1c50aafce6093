"""A key/value cache that grows in blocks instead of re-concatenating every step.

transformers' `DynamicLayer` builds new key and value tensors with `torch.cat` at every token,
copying the whole history (two allocations + copies per layer and token), and its
`DynamicSlidingWindowLayer` does the same before cutting the result back to the window.
`BlockLayer` and `BlockSlidingLayer` keep the positions in a buffer with room for `BLOCK` more and
hand out views of the cached part (a sliding window's view moves along the buffer; when the buffer
is full, the window is copied to the front of a new one). The values are the same, only their
storage differs, so attention computes the same result.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

BLOCK = 256  # tokens of headroom per growth: at most this much unused memory per layer


def _length(rows: torch.Tensor | None) -> int:
    return rows.shape[-2] if rows is not None and rows.dim() == 4 else 0


def _start_in(buffer: torch.Tensor | None, rows: torch.Tensor) -> int | None:
    """The buffer position where `rows` begin, if they are a run of `buffer`'s positions; else None
    (they were replaced: a crop, beams, another cache's tensors)."""
    if buffer is None or rows.shape[:-2] != buffer.shape[:-2] or rows.stride() != buffer.stride():
        return None
    start, off = divmod(rows.data_ptr() - buffer.data_ptr(), buffer.stride(-2) * buffer.element_size())
    return start if off == 0 and start >= 0 and start + rows.shape[-2] <= buffer.shape[-2] else None


def _room(buffer: torch.Tensor | None, filled: torch.Tensor | None, like: torch.Tensor, m: int,
          start: int | None, expected: int = 0) -> tuple[torch.Tensor, int]:
    """(a buffer holding `filled` (n positions) at [start, start + n), with room behind them for `m`
    more, start): the given buffer where `filled` already lies in it at `start` with that room, else
    a new one with `filled` copied to its front, with room for `expected` positions in all if more."""
    n = _length(filled)
    if n == 0:
        start = 0
    if (buffer is None or start is None or buffer.shape[:-2] != like.shape[:-2] or buffer.dtype != like.dtype
            or buffer.shape[-2] < start + n + m):
        capacity = -(-(max(n + m, expected) + BLOCK) // BLOCK) * BLOCK
        buffer, start = like.new_empty((*like.shape[:-2], capacity, like.shape[-1])), 0
        if n:
            buffer[..., :n, :].copy_(filled)
    return buffer, start


class _BufferedLayer:
    """Keys and values as views of growing buffers, for the cache layers below: the cached positions
    are [_start, _start + length) of `_key_buffer` and `_value_buffer`.

    The views are made when someone looks (the per-layer path, transformers' cache methods): a
    native decode step only counts the positions it wrote (`grow_by`), instead of slicing two
    tensors per layer and token. Views set from outside (a crop, beams) are taken as they are; the
    next growth copies them into a buffer again.
    """

    def _init_buffers(self) -> None:
        self._grown = 0  # positions a native step wrote behind the views, not yet in them
        self._start: int | None = None  # where the views begin in the buffers; None: unknown
        self._keys = self._values = None
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # positions the first buffer makes room for: a prompt fed in chunks then grows it once, not once a
        # chunk (each growth holds the old buffer and the new one, copied, at the same time)
        self.expected = 0

    def _keep(self, n: int) -> int:
        """Of n positions in the buffers, how many the cache keeps (the last ones)."""
        return n

    @property
    def keys(self) -> torch.Tensor | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._keys, self._start = value, None

    @property
    def values(self) -> torch.Tensor | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._values, self._start = value, None

    def _settle(self) -> None:
        if self._grown:
            end = self._start + _length(self._keys) + self._grown
            begin = end - self._keep(end - self._start)
            self._grown = 0
            self._keys, self._values = self._key_buffer[..., begin:end, :], self._value_buffer[..., begin:end, :]
            self._start = begin

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `keys`/`values` behind the cached positions; returns the views of all of them,
        and keeps (as the cache) the last `_keep` of them."""
        self._settle()
        n, m = _length(self._keys), keys.shape[-2]
        start = self._where()
        expected = self._keep(self.expected)
        self._key_buffer, start_k = _room(self._key_buffer, self._keys, keys, m, start, expected)
        self._value_buffer, start_v = _room(self._value_buffer, self._values, values, m, start, expected)
        assert start_k == start_v  # both moved, or neither: they were checked together
        end = start_k + n + m
        self._key_buffer[..., start_k + n : end, :].copy_(keys)
        self._value_buffer[..., start_k + n : end, :].copy_(values)
        full_keys, full_values = self._key_buffer[..., start_k:end, :], self._value_buffer[..., start_k:end, :]
        begin = end - self._keep(n + m)
        self._keys, self._values = self._key_buffer[..., begin:end, :], self._value_buffer[..., begin:end, :]
        self._start = begin
        return full_keys, full_values

    def _where(self) -> int | None:
        """Where the views begin in both buffers (None unless both are runs of them, at one place)."""
        if self._start is not None:
            return self._start
        if _length(self._keys) == 0:
            return 0
        start = _start_in(self._key_buffer, self._keys)
        return start if start is not None and start == _start_in(self._value_buffer, self._values) else None

    def reserve_next(self, m: int = 1) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(key buffer, value buffer, start, length): positions [start, start + length) of the
        buffers are the ones a new token attends to besides itself, and there is room right behind
        them for that token's key and value (and for `m - 1` more: a short prompt's tokens as rows of
        one step, each attending to the ones before it), which a native step writes there and then
        counts with `grow_by`. Only for a cache that holds its buffers (a prompt, or `open_empty`)."""
        n = _length(self._keys) + self._grown
        start = self._start
        if start is None or self._key_buffer is None or self._key_buffer.shape[-2] < start + n + m:
            # full, or the views were replaced: into a buffer with room, the kept positions at its front
            self._settle()
            n = _length(self._keys)
            assert self._keys is not None and self._keys.dim() == 4, "reserve_next: the cache has no buffers yet"
            where = self._where()
            self._key_buffer, start = _room(self._key_buffer, self._keys, self._keys, m, where)
            self._value_buffer, _ = _room(self._value_buffer, self._values, self._values, m, where)
            self._keys = self._key_buffer[..., start : start + n, :]
            self._values = self._value_buffer[..., start : start + n, :]
            self._start = start
        kept = self._keep(n)
        return self._key_buffer, self._value_buffer, start + n - kept, kept

    def open_empty(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Give a layer that holds nothing yet its buffers, shaped as `keys` and `values` ([1, heads,
        0, width]: no positions), so a native step can write its first positions (`reserve_next`)."""
        assert _length(keys) == 0 and not self.get_seq_length(), "open_empty: for a layer with no positions"
        self.update(keys, values)

    def grow_by(self, n: int = 1) -> None:
        """`n` more positions of the buffers (written by the caller) are part of the cache now."""
        self._grown += n


class BlockLayer(_BufferedLayer, DynamicLayer):
    """transformers' `DynamicLayer` (every position) in growing buffers."""

    def __init__(self) -> None:
        self._init_buffers()
        super().__init__()

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self._grown
        return _length(self._keys) + self._grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append(key_states, value_states)

    def reset(self) -> None:
        self._init_buffers()
        super().reset()


class BlockSlidingLayer(_BufferedLayer, DynamicSlidingWindowLayer):
    """transformers' `DynamicSlidingWindowLayer` (the last window - 1 positions) in growing buffers.
    While it records its past for a later crop (assisted decoding), it is transformers' own."""

    def __init__(self, sliding_window: int, **kwargs) -> None:
        self._init_buffers()
        super().__init__(sliding_window, **kwargs)

    def _keep(self, n: int) -> int:
        return min(n, self.sliding_window - 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.record_past:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        return self._append(key_states, value_states)

    def grow_by(self, n: int = 1) -> None:
        super().grow_by(n)
        self.cumulative_length += n

    def reset(self) -> None:
        self._init_buffers()
        super().reset()


def new_cache(model: torch.nn.Module) -> DynamicCache | None:
    """transformers' dynamic cache for `model`, its plain and sliding-window layers replaced by
    block-growing ones (other special layers stay as they are). None for a model with a cache class
    of its own (MiniMax's lightning-attention state): as in transformers' `generate`, the model makes
    it on the first forward and returns it (`cache_argument.cache_from_output`)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = BlockLayer()
        elif type(layer) is DynamicSlidingWindowLayer:
            cache.layers[index] = BlockSlidingLayer(layer.sliding_window)
    return cache


def expect_positions(cache: DynamicCache | None, positions: int) -> None:
    """Tell the cache's block-growing layers how many positions are coming (a whole prompt fed in
    chunks), so each allocates its buffers once; other layers are left as they are."""
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, _BufferedLayer):
            layer.expected = positions
