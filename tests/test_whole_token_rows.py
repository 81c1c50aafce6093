"""Several replies' tokens in one whole-token step (`WholeTokenStep.step_rows`, the path's
`run_together`): every reply gets, bit for bit, the logits, KV cache entries and experts its own step
gives, at its own position, on each family the step computes and in a block format. GPT-OSS's
transposed experts take one reply per step. New replies' short prompts run in the same step as the
others' tokens, each as it runs alone. In a batch, replies at budget `all` decode together."""

from __future__ import annotations

import pytest
import torch

from engine.decode.generation import Generator
from engine.decode.kv_cache import new_cache
from engine.decode.paths.base import Step
from engine.decode.runtime import MoERuntime
from engine.protocol import LoadModel
from tests.test_batch import LENGTHS, PROMPTS, greedy, run_batch
from tests.test_whole_token import fast_runtime, latent_checkpoint, prefilled

pytestmark = pytest.mark.usefixtures("kernels")  # the native kernels (tests/conftest.py)

ROWS_PROMPTS = [[5, 17, 33, 8, 61, 12, 40, 9, 27, 4], [3, 5, 7], [100, 2, 40, 41, 42, 43, 44], [9, 9, 1, 2, 3]]


def assert_rows_equal_each_alone(runtime: MoERuntime, prompts: list[list[int]], steps: int) -> None:
    """`steps` tokens of every prompt's reply, all in one step each time and each alone, side by side
    from the same prompts (so at different positions): identical logits, experts and KV caches."""
    path = runtime.whole_token
    together = [prefilled(runtime, prompt) for prompt in prompts]
    alone = [prefilled(runtime, prompt) for prompt in prompts]
    tokens = [prompt[-1] for prompt in prompts]
    counters = runtime.counters
    with torch.inference_mode():
        for _ in range(steps):
            counters.keep_token_picks = False
            ran = path.run_together([Step(torch.tensor([[t]]), kv, kv.get_seq_length(), token=t)
                                     for t, kv in zip(tokens, together, strict=True)])
            for row, (token, kv) in enumerate(zip(tokens, alone, strict=True)):
                step = Step(torch.tensor([[token]]), kv, kv.get_seq_length(), token=token)
                assert path.unavailable(step) is None
                counters.keep_token_picks = True
                own = path.run(step)
                assert torch.equal(ran.logits[row], own), f"row {row}"
                assert (ran.picks[row] == counters.take_token_picks()).all(), f"row {row}'s experts"
            assert ran.uses == len(prompts) * ran.picks[0].size
            assert 0 < ran.distinct <= ran.uses
            tokens = [int(out[0, -1].argmax()) for out in ran.logits]
    counters.keep_token_picks = False
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a.layers, b.layers, strict=True):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("family", ["demo", "mixtral", "qwen2_moe", "olmoe"])
def test_replies_in_one_step_get_their_own_logits(tiny_checkpoints, family):
    # demo: Qwen3-MoE-shaped; Qwen2-MoE: biased q/k/v and a gated shared expert; OLMoE: q/k norms
    # over the whole projection (the step's other attention split)
    runtime = fast_runtime("demo" if family == "demo" else str(tiny_checkpoints[family]))
    try:
        assert_rows_equal_each_alone(runtime, ROWS_PROMPTS, 5)
    finally:
        runtime.close()


def test_latent_attention_and_grouped_routing_in_one_step(tmp_path):
    runtime = fast_runtime(latent_checkpoint("deepseek_v3", tmp_path))
    try:
        with torch.no_grad():  # a correction bias that changes which experts are chosen
            for layer in runtime.model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
        assert_rows_equal_each_alone(runtime, ROWS_PROMPTS, 4)
    finally:
        runtime.close()


@pytest.fixture(scope="module", params=[("Q4_K", "Q8_0"), ("Q6_K", "Q6_K")], ids=["q4_k", "q6_k"])
def block_gguf(request, tmp_path_factory) -> str:
    """Mixtral's tiny checkpoint as a GGUF file: Q4_K or Q6_K experts (their dots unpack a block once
    for up to four rows), Q8_0 or Q6_K dense weights."""
    from tests.helpers.gguf_writer import save_tiny_hf, write_gguf

    experts, dense = request.param
    folder = tmp_path_factory.mktemp(experts.lower())
    write_gguf(save_tiny_hf("mixtral", folder / "hf"), folder / "model.gguf", experts=experts, dense=dense)
    return str(folder / "model.gguf")


@pytest.mark.parametrize("int8", [False, True], ids=["16-bit-inputs", "8-bit-inputs"])
def test_every_kernel_variant_gives_each_row_its_own_sums(variant, block_gguf, int8):
    # and so with the opt-in 8-bit inputs (--int8-inputs), whose rows are as much their own
    from engine.decode.modules.whole_token_step import WholeTokenStep
    from engine.decode.native.testing import forced_paths

    runtime = fast_runtime(block_gguf)
    try:
        decoder = WholeTokenStep(runtime.model, runtime.cache, variant)
        together = [prefilled(runtime, prompt) for prompt in ROWS_PROMPTS]
        alone = [prefilled(runtime, prompt) for prompt in ROWS_PROMPTS]
        exact_inputs = [prefilled(runtime, prompt) for prompt in ROWS_PROMPTS[:1]]
        tokens = [prompt[-1] for prompt in ROWS_PROMPTS]
        with torch.inference_mode():
            sixteen_bits = decoder.step(tokens[0], exact_inputs[0])
        with torch.inference_mode(), forced_paths(variant, int8_inputs=int8):
            assert torch.equal(decoder.step(tokens[0], prefilled(runtime, ROWS_PROMPTS[0])), sixteen_bits) != int8
            for _ in range(3):
                logits, _ = decoder.step_rows(tokens, together)
                for row, (token, kv) in enumerate(zip(tokens, alone, strict=True)):
                    assert torch.equal(logits[row:row + 1], decoder.step(token, kv)), (variant.variant.name, row)
                tokens = [int(out[0, -1].argmax()) for out in logits]
            # a 40-token prompt as rows: about 10 rows an expert (a block's levels made once for four of
            # them, eight with 8-bit inputs) against its tokens one by one
            prompt = [(11 * i + 7) % 120 + 3 for i in range(40)]
            rows, one_by_one = new_cache(runtime.model), new_cache(runtime.model)
            logits = decoder.step_prompt(prompt, rows)
            alone_logits = decoder.step_prompt(prompt[:1], one_by_one)
            for token in prompt[1:]:
                alone_logits = decoder.step(token, one_by_one)
            assert torch.equal(logits, alone_logits), variant.variant.name
    finally:
        runtime.close()


def test_block_formats_and_uneven_thread_shares(block_gguf):
    # Q4_K or Q6_K experts and Q8_0 or Q6_K dense weights (their integer dots); 3 threads:
    # the union of experts and the kv heads split unevenly, the other code paths
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    runtime = fast_runtime(block_gguf)
    try:
        assert runtime.cache.quantized_slots
        assert_rows_equal_each_alone(runtime, ROWS_PROMPTS[:3], 4)
    finally:
        runtime.close()
        torch.set_num_threads(threads)


def test_transposed_experts_take_one_reply_per_step(tiny_checkpoints):
    runtime = fast_runtime(str(tiny_checkpoints["gpt_oss"]))
    try:
        assert runtime.whole_token.decoder.transposed
        assert_rows_equal_each_alone(runtime, ROWS_PROMPTS[:2], 3)
    finally:
        runtime.close()


def mixtral_at_all(tiny_checkpoints) -> tuple[MoERuntime, list, list]:
    """The tiny Mixtral at budget `all`, the batch tests' requests, and each one's reply alone."""
    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints["mixtral"]), budget="all", store="ram",
                                   dtype="bfloat16"))
    requests = [(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    return runtime, requests, [Generator(runtime).generate(p, settings) for p, settings in requests]


def test_a_batch_at_all_decodes_its_replies_in_one_step(tiny_checkpoints):
    runtime, requests, alone = mixtral_at_all(tiny_checkpoints)
    try:
        assert runtime.decode_path == "fast: whole token in one native call"
        together, batch = run_batch(runtime, requests, gather=True)
        for one, reply in zip(alone, together, strict=True):
            assert reply.token_ids == one.token_ids and reply.finish_reason == one.finish_reason
            assert reply.stats.decode_tokens == one.stats.decode_tokens
        sharing = batch.sharing.snapshot()
        assert sharing is not None and sharing.turns > 0 and sharing.picks_per_expert >= 1.0
    finally:
        runtime.close()


def assert_prompts_beside_replies_are_their_own(runtime: MoERuntime, prompts: list[list[int]],
                                                decoding: list[list[int]]) -> None:
    """New `prompts` (short, into empty caches) and the next tokens of replies to `decoding` in one
    `run_together`, and each alone: identical logits, experts and KV caches, and the expert cache
    counts the same picks."""
    path, counters = runtime.whole_token, runtime.counters

    def steps(caches_of_prompts, caches_of_replies):
        return ([Step(torch.tensor([prompt]), kv, 0) for prompt, kv in zip(prompts, caches_of_prompts, strict=True)]
                + [Step(torch.tensor([[r[-1]]]), kv, kv.get_seq_length(), token=r[-1])
                   for r, kv in zip(decoding, caches_of_replies, strict=True)])

    together = steps([new_cache(runtime.model) for _ in prompts], [prefilled(runtime, r) for r in decoding])
    alone = steps([new_cache(runtime.model) for _ in prompts], [prefilled(runtime, r) for r in decoding])
    with torch.inference_mode():
        assert all(path.unavailable(step) is None for step in together)
        before = counters.activation_total.copy()
        ran = path.run_together(together)
        counted = counters.activation_total - before
        for index, step in enumerate(alone):
            counters.keep_token_picks = True
            own = path.run(step)
            picks = counters.take_token_picks()
            counters.keep_token_picks = False
            assert torch.equal(ran.logits[index], own), f"step {index}"
            if index >= len(prompts):
                assert (ran.picks[index] == picks).all(), f"reply {index}'s experts"
            else:
                assert ran.picks[index] is None
        assert (counters.activation_total - before - counted == counted).all()  # the same picks counted
    assert ran.uses == len(decoding) * ran.picks[-1].size
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a.kv.layers, b.kv.layers, strict=True):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("family", ["demo", "deepseek_v3"])
def test_new_prompts_run_in_the_step_of_the_others_tokens(tiny_checkpoints, tmp_path, family):
    # DeepSeek-V3: latent attention (its cache holds latents) and a dense first layer
    runtime = fast_runtime("demo" if family == "demo" else latent_checkpoint(family, tmp_path))
    try:
        assert_prompts_beside_replies_are_their_own(runtime, [[4, 9, 12, 30, 2], [7, 7, 8]], ROWS_PROMPTS[:2])
    finally:
        runtime.close()


def test_more_rows_than_one_step_takes_run_in_several(block_gguf):
    # 4 prompts of 16 tokens and 2 replies: 66 rows, more than the 64 of one native step
    runtime = fast_runtime(block_gguf)
    try:
        prompts = [[(7 * p + 3 * i) % 90 + 5 for i in range(16)] for p in range(4)]
        assert_prompts_beside_replies_are_their_own(runtime, prompts, ROWS_PROMPTS[:2])
    finally:
        runtime.close()


def test_replies_joining_a_batch_at_all_run_their_prompts_in_its_step(tiny_checkpoints):
    runtime, requests, alone = mixtral_at_all(tiny_checkpoints)
    try:
        native = runtime.whole_token.decoder._native
        calls, rows = [], native.run

        def counted(tokens, *args, **kwargs):  # the real step, its calls counted
            calls.append(len(tokens))
            return rows(tokens, *args, **kwargs)

        native.run = counted
        together, _ = run_batch(runtime, requests, gather=True, pack=True, join_after={1: 2, 2: 2, 3: 5})
        for one, reply in zip(alone, together, strict=True):
            assert reply.token_ids == one.token_ids and reply.finish_reason == one.finish_reason
        # one native step a turn: the turns where prompts joined ran them beside the others' tokens
        assert len(calls) == max(join + n for join, n in zip((0, 2, 2, 5), LENGTHS, strict=True))
        assert calls[2] == len(PROMPTS[1]) + len(PROMPTS[2]) + 1 and calls[5] == len(PROMPTS[3]) + 3
    finally:
        runtime.close()
