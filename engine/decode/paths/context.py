"""What the decode paths read of a loaded model: the model, its expert cache, where and in what it
computes, and the switches the user changes between tokens. The runtime makes one and hands it to
every path, so a path sees these and nothing else of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.offload.expert_cache import ExpertCache


@dataclass
class DecodeSettings:
    """Live: the runtime changes them between tokens; the paths read them at every step."""

    fast_decode: bool = False  # the native paths asked for (off: --exact, the System panel's Exact switch)
    int8_inputs: bool = False  # opt-in, lossy: 8-bit inputs to K-quant matrices, prompt and decode (the System panel's switch)
    routing_restricted: bool = False  # a lossy policy rewrites the routers' choices, layer by layer


@dataclass(frozen=True)
class DecodeContext:
    """One loaded model as its decode paths see it; the same objects for the whole session."""

    model: torch.nn.Module
    cache: ExpertCache
    device: torch.device
    dtype: torch.dtype
    settings: DecodeSettings
