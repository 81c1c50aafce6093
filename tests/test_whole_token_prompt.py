"""A short prompt as the rows of one whole-token step (`WholeTokenStep.step_prompt`): the same bits as
its tokens one by one through the step, its experts counted, its logits and KV cache the exact path's
to the fast path's tolerance, on each family the step computes (bf16 and a block format). Longer
prompts, a cache that holds positions already and GPT-OSS's transposed experts take the other
paths, with the reason."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.decode.generation import Generator
from engine.decode.kv_cache import new_cache
from engine.decode.paths.whole_token import WholeTokenPath
from engine.decode.runtime import MoERuntime
from engine.protocol import SamplingSettings
from tests.helpers.numerics import close_or_nearer_float32, float32_prompt, same_top
from tests.test_whole_token import PROMPT, fast_runtime, latent_checkpoint
from tests.test_whole_token_rows import block_gguf  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("kernels")  # the native kernels (tests/conftest.py)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def assert_prompt_rows_match_the_exact_path(runtime: MoERuntime, prompt: list[int], kv_to_exact: bool = True) -> None:
    """The prompt as rows of one step: the same bits as its tokens fed one by one through the step
    (each attends to itself and the ones before it), its experts counted, and the exact path's
    logits (and KV cache, where `kv_to_exact`) to the fast path's tolerance."""
    generator = Generator(runtime)
    greedy = SamplingSettings(temperature=0, max_new_tokens=4)
    counters = runtime.counters
    decoder = runtime.whole_token.decoder
    with torch.inference_mode():
        rows = generator.start(prompt, greedy)
        path, forward = rows.prepare()
        assert isinstance(path, WholeTokenPath), path.label
        before = counters.activation_request.sum(axis=1)
        logits = path.run(forward)
        # the expert cache counted every token of the prompt in every MoE layer
        assert (counters.activation_request.sum(axis=1) - before == len(prompt) * runtime.layout.top_k).all()
        one_by_one = new_cache(runtime.model)
        alone = decoder.step_prompt(prompt[:1], one_by_one)
        for token in prompt[1:]:
            alone = decoder.step(token, one_by_one)
        runtime.set_fast_decode(False)
        exact = generator.start(prompt, greedy)
        exact_path, exact_forward = exact.prepare()
        reference = exact_path.run(exact_forward)
        runtime.set_fast_decode(True)
    assert torch.equal(logits, alone)
    for a, b in zip(rows.kv.layers, one_by_one.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert logits.shape == reference.shape == (1, 1, runtime.model.config.vocab_size)
    # the fast path's tolerance, or (where the bf16 reference drifts from the float32 model further than
    # that) no further from the float32 model than the reference
    float32 = functools.cache(lambda: float32_prompt(runtime, prompt))
    close_or_nearer_float32(logits, reference, lambda: float32()[0], "the prompt's logits", 0.12)
    same_top(logits, reference, "the prompt's logits")
    assert rows.kv.get_seq_length() == exact.kv.get_seq_length() == len(prompt)
    for index, (a, b) in enumerate(zip(rows.kv.layers, exact.kv.layers, strict=True)):
        assert a.keys.shape == b.keys.shape, index
        if kv_to_exact:
            for ours, theirs, name in ((a.keys, b.keys, "keys"), (a.values, b.values, "values")):
                if relative(ours, theirs) >= 0.05:
                    truth = getattr(float32()[1].layers[index], name)
                    assert relative(ours, truth) <= relative(theirs, truth) + 0.01, (index, name)
    # and the reply decodes on from there, on the step
    rows.finish(forward, logits)
    with torch.inference_mode():
        path, forward = rows.prepare()
        assert isinstance(path, WholeTokenPath) and forward.position == len(prompt)
        path.run(forward)


@pytest.mark.parametrize("family", ["demo", "mixtral", "qwen2_moe", "olmoe", "glm4_moe"])
def test_a_short_prompt_runs_as_rows_of_one_step(tiny_checkpoints, family):
    runtime = fast_runtime("demo" if family == "demo" else str(tiny_checkpoints[family]))
    try:
        assert_prompt_rows_match_the_exact_path(runtime, PROMPT)
        assert_prompt_rows_match_the_exact_path(runtime, [7])  # one token: one row
    finally:
        runtime.close()


def test_latent_attention_writes_a_prompts_latents(tmp_path):
    runtime = fast_runtime(latent_checkpoint("deepseek_v3", tmp_path))
    try:
        # grouped routing: a token whose group flips between the step and the exact path (one of this
        # prompt's, measured) changes its latents in the layers after, so those are held to the step's
        # own token by token, and the logits to the exact path's
        assert_prompt_rows_match_the_exact_path(runtime, PROMPT, kv_to_exact=False)
    finally:
        runtime.close()


def test_block_formats(block_gguf):  # noqa: F811
    runtime = fast_runtime(block_gguf)
    try:
        assert runtime.cache.quantized_slots
        assert_prompt_rows_match_the_exact_path(runtime, PROMPT + PROMPT[:6])
        # the longest prompt one step takes: 64 rows
        assert_prompt_rows_match_the_exact_path(runtime, [(13 * i + 5) % 120 + 3 for i in range(64)])
    finally:
        runtime.close()


def test_what_the_rows_do_not_take_goes_elsewhere_with_the_reason(tiny_checkpoints):
    runtime = fast_runtime(str(tiny_checkpoints["mixtral"]))
    try:
        generator = Generator(runtime)
        greedy = SamplingSettings(temperature=0, max_new_tokens=2)
        step = runtime.whole_token
        _, forward = generator.start([3 + i % 90 for i in range(65)], greedy).prepare()  # 65 tokens
        assert step.unavailable(forward) == "prompts of more than 64 tokens take the prompt path"
        runtime.prefill_chunk_tokens = 4  # a prompt in chunks: the second extends a cache
        sequence = generator.start(PROMPT, greedy)
        assert sequence.step()
        _, forward = sequence.prepare()
        assert forward.prefill and step.unavailable(forward).startswith("prompts go into an empty cache")
    finally:
        runtime.close()
    runtime = fast_runtime(str(tiny_checkpoints["gpt_oss"]))
    try:
        sequence = Generator(runtime).start(PROMPT, SamplingSettings(temperature=0, max_new_tokens=2))
        _, forward = sequence.prepare()
        assert runtime.whole_token.unavailable(forward) == "transposed experts (GPT-OSS's) run one token per step"
        assert torch.isfinite(sequence.prepare()[0].run(forward).float()).all()
    finally:
        runtime.close()
