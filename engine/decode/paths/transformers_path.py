"""The exact path: the model's own forward with transformers' kernels (every step can take it)."""

from __future__ import annotations

import functools
import inspect

import torch

from engine.decode.paths.base import DecodePath, Step
from engine.model.cache_argument import cache_argument, cache_from_output


def last_position(input_ids: torch.Tensor) -> torch.Tensor:
    """The index of the last position, as the tensor form of `logits_to_keep`.

    `logits_to_keep=1` slices the last hidden state as a non-contiguous view; with parameters that
    do not require grad (ours), torch's matmul then takes a batched path that copies the whole
    transposed LM head (65 MB for a 32k vocabulary, every prompt). An index tensor
    gathers a contiguous row instead: the same values into the same matrix product."""
    return torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)


@functools.cache
def takes_position_ids(model_class: type) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters


def model_forward(model: torch.nn.Module, step: Step) -> torch.Tensor:
    """The model's forward over the step's tokens, extending its KV cache; last position's logits
    (every position's when the step asks).
    A step without a cache gets the one the model makes (a cache class of its own, `kv_cache.new_cache`).
    Positions are passed as `generate` passes them: a model may derive wrong ones from the mask alone
    (Qwen3-Omni's thinker takes every masked position as the new tokens' while decoding)."""
    ids = step.input_ids
    attention = torch.ones((1, step.position + ids.shape[1]), dtype=torch.long, device=ids.device)
    positions = {}
    if takes_position_ids(type(model)):
        positions["position_ids"] = torch.arange(step.position, step.position + ids.shape[1], device=ids.device)[None]
    output = model(input_ids=ids, attention_mask=attention, **cache_argument(model, step.kv), use_cache=True,
                   logits_to_keep=0 if step.every_position else last_position(ids), **positions)
    if step.kv is None:
        step.kv = cache_from_output(output)
    return output.logits


class TransformersPath(DecodePath):
    label = "exact: transformers' kernels"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def unavailable(self, step: Step) -> str | None:
        return None

    def run(self, step: Step) -> torch.Tensor:
        return model_forward(self.model, step)
