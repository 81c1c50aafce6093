"""Several replies' prompts in one forward of the model (the prompt path's `run_together`).

The prompts are laid end to end as one row of tokens, each with its own positions from 0, under
the mask transformers makes for packed sequences (`create_causal_mask` given restarting
positions): a token attends only to its own prompt's earlier tokens. Each layer's keys and values
go, prompt by prompt, straight into each reply's own KV cache (`_SplitCache`). So the weights are
read, and each expert loaded, once for all of them, and the forward's fixed costs (every layer's
Python and small ops) are paid once, as llama.cpp's server puts its slots' prompts in one batch.

Reference: each prompt's logits and KV entries are those of transformers on the same (dequantized)
weights, within the prompt path's tolerance, as the prompt alone on this path is; they are not
bit for bit the prompt alone (an expert's rows may take another kernel for their count, and the
attention is masked rather than causal). The exact path never packs.

Only a fresh reply's first forward packs (every cache layer empty and block-growing), on the
families whose packed forward is tested, and within any sliding window (there the window's mask is
the causal one).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from engine.decode.kv_cache import BlockLayer, BlockSlidingLayer
from engine.decode.modules.families import attention_windows
from engine.decode.paths.base import Step
from engine.decode.paths.transformers_path import takes_position_ids
from engine.model.cache_argument import cache_argument

# decoders whose forward takes a packed row of prompts: positions passed through to a rotary table,
# a 4-D mask used as given (tests/test_packed_prompts.py runs each)
PACKED_FAMILIES = frozenset({"qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe"})


def packs(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes a packed row of prompts (a listed family)."""
    return _text_config(model).model_type in PACKED_FAMILIES and takes_position_ids(type(model))


def smallest_window(model: torch.nn.Module) -> int | None:
    """The narrowest of the model's `attention_windows`; None if none slides."""
    return min((window for window in attention_windows(model) if window), default=None)


def packable(step: Step, window: int | None) -> bool:
    """Whether `step` of a model that `packs` may go into a packed forward: a fresh reply's first
    prompt forward, shorter than the model's `smallest_window`."""
    if not step.prefill or step.position or step.every_position or step.kv is None:
        return False
    if window is not None and step.input_ids.shape[1] >= window:
        return False
    layers = getattr(step.kv, "layers", None)
    return bool(layers) and all(type(layer) in (BlockLayer, BlockSlidingLayer) and not layer.get_seq_length()
                                for layer in layers)


def packed_forward(model: torch.nn.Module, steps: list[Step]) -> list[torch.Tensor]:
    """One forward of the `packable` steps' prompts, end to end; each step's last-position logits,
    [1, 1, vocab], and each step's KV cache filled with its prompt."""
    ids = torch.cat([step.input_ids for step in steps], dim=1)
    lengths = [step.input_ids.shape[1] for step in steps]
    ends = torch.tensor(lengths, device=ids.device).cumsum(0)
    positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]
    # create_causal_mask reads only the batch, the length, the dtype and the device of the embeddings
    shape_of = torch.empty((1, ids.shape[1], 1), dtype=model.dtype, device=ids.device)
    mask = create_causal_mask(_text_config(model), shape_of, None, None, position_ids=positions)
    cache = _SplitCache([step.kv for step in steps], [(int(e) - n, int(e)) for e, n in zip(ends, lengths, strict=True)])
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(model, cache),
                   use_cache=True, logits_to_keep=ends - 1)
    return list(output.logits.split(1, dim=1))


def _text_config(model: torch.nn.Module):
    return model.config.get_text_config(decoder=True)


class _SplitCache(DynamicCache):
    """The packed forward's cache: a layer's keys and values go, prompt by prompt, into the replies'
    own caches; attention gets the packed ones back (every reply's cache was empty)."""

    def __init__(self, caches: list[DynamicCache], bounds: list[tuple[int, int]]) -> None:
        super().__init__()
        self.caches, self.bounds = caches, bounds

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for cache, (start, end) in zip(self.caches, self.bounds, strict=True):
            cache.update(key_states[..., start:end, :], value_states[..., start:end, :], layer_idx, *args, **kwargs)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
