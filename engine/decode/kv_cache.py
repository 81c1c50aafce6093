"""A key/value cache that grows in blocks instead of re-concatenating every step.

transformers' `DynamicLayer` builds new key and value tensors with `torch.cat` at every token,
copying the whole history (two allocations + copies per layer and token). `BlockLayer` keeps
them in a buffer with room for `BLOCK` more tokens and hands out views of its filled part; the
values are the same, only their storage differs, so attention computes the same result.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

BLOCK = 256  # tokens of headroom per growth: at most this much unused memory per layer


def _room(buffer: torch.Tensor | None, filled: torch.Tensor, like: torch.Tensor, m: int) -> torch.Tensor:
    """A buffer holding `filled` (n positions) in its first n, with room for `m` more."""
    n = filled.shape[-2] if filled.dim() == 4 else 0
    reusable = (buffer is not None and buffer.shape[:-2] == like.shape[:-2] and buffer.shape[-2] >= n + m
                and (n == 0 or filled.data_ptr() == buffer.data_ptr()))  # `filled` may have been replaced (crop, beams)
    if not reusable:
        capacity = -(-(n + m + BLOCK) // BLOCK) * BLOCK
        buffer = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
        if n:
            buffer[..., :n, :].copy_(filled)
    return buffer


def _append(buffer: torch.Tensor | None, filled: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view of its first n + m positions) after writing `new` behind the n in `filled`."""
    n = filled.shape[-2] if filled.dim() == 4 else 0
    m = new.shape[-2]
    buffer = _room(buffer, filled, new, m)
    buffer[..., n : n + m, :].copy_(new)
    return buffer, buffer[..., : n + m, :]


class BlockLayer(DynamicLayer):
    def __init__(self) -> None:
        self._grown = 0  # positions a native step wrote behind `_keys`/`_values`, not yet in the views
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    # The views are made when someone looks (the per-layer path, transformers' cache methods): a
    # native decode step only counts the positions it wrote (`grow_by_one`), instead of slicing two
    # tensors per layer and token.
    @property
    def keys(self) -> torch.Tensor | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._values = value

    def _settle(self) -> None:
        if self._grown:
            n = self._keys.shape[-2] + self._grown
            self._grown = 0
            self._keys, self._values = self._key_buffer[..., :n, :], self._value_buffer[..., :n, :]

    def get_seq_length(self) -> int:
        if not self.is_initialized or self._keys is None or self._keys.dim() != 4:
            return self._grown
        return self._keys.shape[-2] + self._grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._key_buffer, self.keys = _append(self._key_buffer, self.keys, key_states)
        self._value_buffer, self.values = _append(self._value_buffer, self.values, value_states)
        return self.keys, self.values

    def reserve_next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, with room for one more position behind the filled ones (for a
        native decode step that writes it in place, then calls `grow_by_one`)."""
        keys, values = self._key_buffer, self._value_buffer
        fits = (keys is not None and values is not None and keys.shape[-2] > self.get_seq_length()
                and self._keys.data_ptr() == keys.data_ptr() and self._values.data_ptr() == values.data_ptr())
        if not fits:  # full, or the views were replaced (crop, beams): a new buffer, filled part copied
            self._key_buffer = _room(keys, self.keys, self.keys, 1)
            self._value_buffer = _room(values, self.values, self.values, 1)
        return self._key_buffer, self._value_buffer

    def grow_by_one(self) -> None:
        """One more position of the buffers (written by the caller) is part of the cache now."""
        self._grown += 1

    def reset(self) -> None:
        self._grown = 0
        self._key_buffer = self._value_buffer = None
        super().reset()


def new_cache(model: torch.nn.Module) -> DynamicCache | None:
    """transformers' dynamic cache for `model`, its plain layers replaced by block-growing ones
    (sliding-window and other special layers stay as they are). None for a model with a cache class
    of its own (MiniMax's lightning-attention state): as in transformers' `generate`, the model makes
    it on the first forward and returns it (`cache_argument.cache_from_output`)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = BlockLayer()
    return cache
