"""The offloading engine as a backend for the demo model's evaluation (`engine.demo.evaluate`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.decode.generation import Generator
from engine.decode.runtime import MoERuntime
from engine.protocol import SamplingSettings


def engine_answer_fn(runtime: MoERuntime, max_new_tokens: int = 48):
    """Greedy replies to single-turn chats, through the engine (cache, store, policy and all)."""
    generator = Generator(runtime)

    def answer(users: Sequence[str]) -> list[str]:
        settings = SamplingSettings(temperature=0, max_new_tokens=max_new_tokens)
        return [
            generator.generate(generator.encode_chat([{"role": "user", "content": u}]), settings).text for u in users
        ]

    return answer


def engine_expert_usage(runtime: MoERuntime, users: Sequence[str]) -> np.ndarray:
    """[layers, experts]: top-k selections over the prompt tokens of `users`, counted by the engine."""
    generator = Generator(runtime)
    usage = np.zeros((runtime.layout.num_layers, runtime.layout.num_experts), dtype=np.int64)
    for user in users:
        ids = generator.encode_chat([{"role": "user", "content": user}])
        generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=1))  # the prefill only
        usage += runtime.counters.activation_request
    return usage
