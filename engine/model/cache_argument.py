"""The keyword under which a transformers forward takes its KV cache.

transformers up to 5.23 names it `past_key_values`; 5.24 renamed it `cache` (the old name still
works until 5.40, with a FutureWarning on every call). Passing the name the installed version
declares keeps both quiet and correct."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _keyword(module_type: type) -> str:
    parameters = inspect.signature(module_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(module: torch.nn.Module, kv) -> dict:
    """`{keyword: kv}` for `module(...)`, in the name its forward declares."""
    return {_keyword(type(module)): kv}


def cache_from_call(args: tuple, kwargs: dict):
    """The KV cache a layer's forward was given after (hidden, position_embeddings, mask), under
    either name or positionally; None if none was."""
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args else None


def cache_from_output(output):
    """The KV cache a transformers forward returned, under either version's name."""
    for name in ("cache", "past_key_values"):
        if getattr(output, name, None) is not None:
            return getattr(output, name)
    return None
