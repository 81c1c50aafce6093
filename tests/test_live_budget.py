"""Changing the budget while a reply is being generated: slots change before the next token, output stays exact."""

from __future__ import annotations

from engine.decode.generation import Generator
from engine.decode.runtime import MoERuntime
from engine.protocol import LoadModel, SamplingSettings
from tests.helpers.checkpoints import reference_generate

PROMPT = [1, 23, 45, 67, 8, 9, 10]


def test_budget_change_mid_reply_applies_between_tokens_and_stays_exact(mixtral_checkpoint):
    expected = reference_generate(mixtral_checkpoint, PROMPT, 16)
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="all", store="disk"))
    full_slots = runtime.cache.slots_per_layer
    generator = Generator(runtime)
    slots_seen: list[list[int]] = []
    tokens_seen: list[int] = []

    def between_tokens() -> bool:
        # The worker does exactly this: apply pending commands between two tokens.
        slots_seen.append(runtime.cache.slots_per_layer)
        if len(tokens_seen) == 3:
            runtime.set_budget("1")  # down to the minimum
        if len(tokens_seen) == 9:
            runtime.set_budget("75%")
        return False

    result = generator.generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=16), on_token=tokens_seen.append,
                                between_tokens=between_tokens)
    runtime.close()
    assert result.token_ids == expected
    top_k = runtime.layout.top_k
    assert slots_seen[2] == full_slots
    assert slots_seen[3] == [top_k] * runtime.layout.num_layers  # the very next token ran with the new pool
    assert sum(slots_seen[9]) == int(0.75 * sum(full_slots))
    assert result.stats.misses > 0  # shrinking really forced loads


def test_growing_keeps_resident_experts(mixtral_checkpoint):
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="1", store="ram"))
    before = runtime.cache.resident_matrix()
    runtime.set_budget("all")
    after = runtime.cache.resident_matrix()
    runtime.close()
    assert (after[before]).all()  # nothing that was resident got dropped
    assert after.sum() == before.sum()  # and nothing new was fetched just by resizing
