"""Block-diffusion models (transformers' `...ForBlockDiffusion`, DiffusionGemma): the model's own loop.

Such a model writes a reply a block at a time: an encoder reads what is written so far, then a
canvas of random tokens is denoised in several forwards until it settles, and the block is
appended. MoEScope does not re-implement that loop: it runs the model's own `generate`, whose
forwards reach the offloaded experts through the same cache as any other model's, and reads the
blocks through transformers' streamer interface: each denoising forward ends one step for the
counters and the panels, each finished block enters the reply token by token (stop tokens, stop
strings and cancellation as in the token-by-token loop).

The model samples with its own schedule (an entropy-bounded acceptance and a temperature ramp,
from its generation config), so temperature, top-p, top-k and the repetition penalty do not apply;
the seed does. A greedy request (temperature 0) uses seed 0, so the same prompt gives the same
reply, as greedy decoding does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

LABEL = "block diffusion: the model's own denoising loop (transformers' kernels)"
REASON = "a block-diffusion model denoises whole blocks in its own generate; the native paths write one token at a time"
GREEDY_SEED = 0
SAMPLING_NOTE = ("a block-diffusion model: replies come a block at a time from its own sampler; temperature, "
                 "top-p, top-k and the repetition penalty do not apply (the seed does; greedy uses seed 0)")


class ReplyOver(Exception):
    """Raised from the streamer to end the model's generate early: the reply is complete."""


class BlockStreamer:
    """transformers' streamer interface for a block-diffusion `generate`. `on_step` after each
    denoising forward, with the block's draft [1, canvas] (True stops the reply), `on_block` when a
    block is finished, then `on_token` for each of its tokens (False stops it)."""

    def __init__(self, on_step: Callable[[torch.Tensor], bool], on_token: Callable[[int], bool],
                 on_block: Callable[[], None]) -> None:
        self.on_step, self.on_token, self.on_block = on_step, on_token, on_block
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate puts the prompt first
            self._prompt_seen = True
            return
        self.on_block()
        for token in value[0].tolist():
            if not self.on_token(int(token)):
                raise ReplyOver

    def put_draft(self, value: torch.Tensor) -> None:
        if self.on_step(value):
            raise ReplyOver

    def end(self) -> None:
        pass


def seed_for(temperature: float, seed: int | None) -> int:
    if seed is not None:
        return seed
    return GREEDY_SEED if temperature <= 0 else int(torch.seed() % (1 << 63))


@torch.inference_mode()
def denoise(model: torch.nn.Module, ids: torch.Tensor, seed: int, max_new_tokens: int,
            streamer: BlockStreamer | None = None, **schedule) -> None:
    """The model's generate over the prompt `ids` [1, n], its random canvases drawn from `seed`
    (the caller's random state is left as it was). `schedule` overrides generation-config fields
    (`max_denoising_steps=1` for a forward that only sets things up)."""
    devices = [ids.device] if ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with contextlib.suppress(ReplyOver):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           streamer=streamer, **schedule)
