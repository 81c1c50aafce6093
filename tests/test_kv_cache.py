"""The block-growing cache layers (engine.decode.kv_cache) hold what transformers' own layers hold:
the same positions, the same values, at every step, whether positions arrive through `update`
(prefill, the per-layer path) or are written in place by a native step (`reserve_next`)."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from engine.decode import kv_cache
from engine.decode.kv_cache import BlockLayer, BlockSlidingLayer

HEADS, DIM = 2, 4


def rows(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(1, HEADS, n, DIM, generator=generator).to(torch.bfloat16)


def write_in_place(layer, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a native step does: write behind the reserved positions; returns what it attends to."""
    keys, values, start, length = layer.reserve_next()
    keys[..., start + length, :].copy_(key[..., 0, :])
    values[..., start + length, :].copy_(value[..., 0, :])
    seen = keys[..., start : start + length + 1, :].clone(), values[..., start : start + length + 1, :].clone()
    layer.grow_by()
    return seen


@pytest.mark.parametrize("window", [None, 6])
def test_block_layers_hold_what_transformers_layers_hold(monkeypatch, window):
    monkeypatch.setattr(kv_cache, "BLOCK", 4)  # the buffers fill and move several times
    generator = torch.Generator().manual_seed(0)
    ours = BlockLayer() if window is None else BlockSlidingLayer(window)
    theirs = DynamicLayer() if window is None else DynamicSlidingWindowLayer(window)
    prompt = rows(9, generator), rows(9, generator)
    for a, b in zip(ours.update(*prompt), theirs.update(*prompt), strict=True):
        assert torch.equal(a, b)
    for step in range(30):
        key, value = rows(1, generator), rows(1, generator)
        expected = theirs.update(key, value)
        # now and then through `update`, as the per-layer path does
        seen = ours.update(key, value) if step % 3 == 2 else write_in_place(ours, key, value)
        assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True)), step
        assert ours.get_seq_length() == theirs.get_seq_length() == 10 + step
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_a_cropped_cache_grows_again_from_what_is_left():
    generator = torch.Generator().manual_seed(1)
    ours, theirs = BlockLayer(), DynamicLayer()
    prompt = rows(5, generator), rows(5, generator)
    ours.update(*prompt)
    theirs.update(*prompt)
    write_in_place(ours, rows(1, generator), rows(1, generator))
    theirs.update(ours.keys[..., -1:, :], ours.values[..., -1:, :])
    ours.crop(-2)
    theirs.crop(-2)
    key, value = rows(1, generator), rows(1, generator)
    seen = write_in_place(ours, key, value)
    expected = theirs.update(key, value)
    assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))
    assert ours.get_seq_length() == theirs.get_seq_length() == 5
    ours.reset()
    assert ours.get_seq_length() == 0
