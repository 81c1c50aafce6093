"""--fast-decode's whole-token path (engine.decode.paths.whole_token): with every expert resident, a
Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3, GLM-4.5 or GLM-4.7-Flash decode token runs in one
native call. It must give the very logits of the
native per-layer path (same kernels, same order), leave the same trail in the counters the panels
draw from, and step aside, saying why, whenever something needs a layer's routing as it happens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.decode.generation import GenerationResult, Generator
from engine.decode.kv_cache import new_cache
from engine.decode.modules.whole_token_step import RotaryRows, _bits, recognise
from engine.decode.paths.base import Step
from engine.decode.runtime import MoERuntime
from engine.model.cache_argument import cache_argument
from engine.protocol import LoadModel, SamplingSettings
from tests.helpers.checkpoints import reference_generate, save_tiny_checkpoint

PROMPT = [5, 17, 33, 8, 61, 12, 40, 9, 27, 4]


pytestmark = pytest.mark.usefixtures("kernels")  # the native kernels (tests/conftest.py)


def fast_runtime(model: str, budget: str = "all") -> MoERuntime:
    return MoERuntime(LoadModel(path=model, budget=budget, store="ram", dtype="bfloat16", fast_decode=True))


@pytest.fixture(params=["demo", "mixtral"])
def model_path(request, tiny_checkpoints) -> str:
    return "demo" if request.param == "demo" else str(tiny_checkpoints["mixtral"])


def prefilled(runtime: MoERuntime, prompt: list[int]):
    cache = new_cache(runtime.model)
    with torch.inference_mode():
        runtime.model(input_ids=torch.tensor([prompt]), **cache_argument(runtime.model, cache), use_cache=True)
    return cache


def assert_steps_match_the_module_path(runtime: MoERuntime, prompt: list[int], steps: int):
    """`steps` tokens through the whole-token path and through the native per-layer path, side by
    side from the same prompt: identical logits at every step, identical KV caches at the end."""
    whole, per_module = prefilled(runtime, prompt), prefilled(runtime, prompt)
    token = prompt[-1]
    with torch.inference_mode():
        for _ in range(steps):
            step = Step(torch.tensor([[token]]), whole, whole.get_seq_length())
            assert runtime.whole_token.unavailable(step) is None
            ours = runtime.whole_token.run(step)
            reference = runtime.native_layers.run(Step(torch.tensor([[token]]), per_module, per_module.get_seq_length()))
            assert ours.dtype == reference.dtype == torch.bfloat16
            assert torch.equal(ours, reference)
            token = int(reference[0, -1].argmax())
    for a, b in zip(whole.layers, per_module.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    return whole, per_module


def test_whole_token_step_gives_the_module_paths_logits(model_path):
    runtime = fast_runtime(model_path)
    try:  # several positions: the step's cache writes must be where attention reads them
        assert_steps_match_the_module_path(runtime, PROMPT, 6)
    finally:
        runtime.close()


def test_tied_router_logits_pick_the_experts_torch_topk_picks(tiny_checkpoints):
    # Equal router rows: every token's expert probabilities tie, so which experts run is torch.topk's
    # order among equal values (transformers' and the per-layer path's), which the step follows
    runtime = fast_runtime(str(tiny_checkpoints["mixtral"]))
    try:
        with torch.no_grad():
            for layer in runtime.model.model.layers:
                layer.mlp.gate.weight.copy_(layer.mlp.gate.weight[:1].expand_as(layer.mlp.gate.weight))
        assert_steps_match_the_module_path(runtime, PROMPT, 4)
    finally:
        runtime.close()


def test_kv_heads_that_do_not_divide_among_the_threads():
    # With 3 threads neither model's kv heads (4 and 2) split evenly: the step projects by heads,
    # then attends by query heads (its other path), and must still match the module path.
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    runtime = fast_runtime("demo")
    try:
        assert_steps_match_the_module_path(runtime, PROMPT, 4)
    finally:
        runtime.close()
        torch.set_num_threads(threads)


def test_rotary_rows_come_a_block_at_a_time_with_the_same_bits(tmp_path):
    # A head size that is a multiple of 32 lets the step take its rotary rows from one call per
    # block of positions; every row must be the bits of the model's own one-position call.
    runtime = fast_runtime(str(save_tiny_checkpoint("mixtral", tmp_path / "wide-heads", head_dim=32)))
    try:
        rows = runtime.whole_token.decoder._rotary_rows
        assert rows.rows == RotaryRows.BLOCK_ELEMENTS // 32  # blocks in use
        for position in [*range(0, rows.rows + 3), 2 * rows.rows - 1, 5 * rows.rows + 17]:
            assert _bits(rows.at(position)) == _bits(rows._single(position)), position
        assert_steps_match_the_module_path(runtime, PROMPT, 4)
    finally:
        runtime.close()


def test_the_kv_cache_grows_under_the_step(monkeypatch):
    # The block buffers keep room for BLOCK more positions; a reply that fills it moves the cache
    # to a bigger buffer mid-reply, and the step must carry on from there. (A small block, so
    # that happens within the demo's context.)
    from engine.decode import kv_cache

    monkeypatch.setattr(kv_cache, "BLOCK", 8)
    runtime = fast_runtime("demo")
    try:
        whole, per_module = assert_steps_match_the_module_path(runtime, PROMPT, 3 * 8)
        # transformers' own cache operations still see the positions the step wrote
        whole.crop(-5)
        per_module.crop(-5)
        assert whole.get_seq_length() == per_module.get_seq_length() == len(PROMPT) + 3 * 8 - 5
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(whole.layers, per_module.layers, strict=True))
        whole.reset()
        assert whole.get_seq_length() == 0
    finally:
        runtime.close()


def test_answers_and_counters_equal_the_module_path(model_path):
    # What the user sees: the same reply, and the same expert heatmap / hit counts in the panels.
    runtime = fast_runtime(model_path)
    try:
        generator = Generator(runtime)
        settings = SamplingSettings(temperature=0, max_new_tokens=24)
        fused_reply = generator.generate(PROMPT, settings)
        assert runtime.decode_path == "fast: whole token in one native call"  # what the System panel shows
        assert runtime.decode_path_reason == ""
        fused_activations = runtime.counters.activation_request.copy()
        fused_hits = runtime.counters.request_layer_hits.copy()
        # the same prompt on the step (its rows, as above), then the native per-layer path only
        runtime.counters.start_request()
        sequence = generator.start(PROMPT, settings)
        assert sequence.step()
        runtime.whole_token._problem = "switched off by the test"
        while sequence.step():
            pass
        module_reply = GenerationResult.of(sequence)
        assert runtime.decode_path == "fast: native kernels, layer by layer"
        assert runtime.decode_path_reason == "switched off by the test"
        assert fused_reply.token_ids == module_reply.token_ids
        assert np.array_equal(fused_activations, runtime.counters.activation_request)
        assert np.array_equal(fused_hits, runtime.counters.request_layer_hits)
        assert fused_reply.stats.decode_hit_rate == 1.0
    finally:
        runtime.close()


def demo_prompt() -> list[int]:
    from transformers import AutoTokenizer

    from resources import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    return tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)


def test_budget_changes_move_the_experts_and_the_step_follows():
    # Shrinking the budget re-plans the slots (the step stands aside while experts are missing);
    # back at `all`, the pools are new memory and the step must read the experts from there.
    from resources import DEMO_MODEL_DIR

    prompt = demo_prompt()
    stock = reference_generate(DEMO_MODEL_DIR, prompt, 32, dtype=torch.bfloat16)
    assert len(stock) > 8
    runtime = fast_runtime("demo")
    try:
        generator = Generator(runtime)
        settings = SamplingSettings(temperature=0, max_new_tokens=32)
        assert generator.generate(prompt, settings).token_ids == stock
        runtime.set_budget("25%")
        assert runtime.cache.whole_token_problem() == "not every expert is resident (the budget is below all)"
        assert generator.generate(prompt, settings).token_ids == stock
        assert runtime.decode_path_reason.startswith("not every expert is resident")
        runtime.set_budget("all")  # growing loads nothing by itself: experts come on demand, or
        runtime.cache.warm()  # all at once, as at load
        assert runtime.cache.whole_token_problem() is None
        assert generator.generate(prompt, settings).token_ids == stock
        assert runtime.decode_path == "fast: whole token in one native call"
        fused = runtime.whole_token.decoder
        assert fused._placed == (runtime.cache.slot_views, runtime.cache.directory.changes)
    finally:
        runtime.close()


def test_lookahead_policies_keep_the_per_layer_path(tiny_checkpoints):
    # A policy that guesses ahead needs each layer's hidden state as it runs: no whole-token step.
    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints["mixtral"]), budget="all", store="ram",
                                     dtype="bfloat16", fast_decode=True, policy="promoe:k=1"))
    try:
        assert runtime.cache.whole_token_problem() == "the policy looks ahead at each layer's routing"
        reply = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=8))
        assert len(reply.token_ids) == 8
        assert runtime.decode_path == "fast: native kernels, layer by layer"
    finally:
        runtime.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "glm4_moe"])
def test_attention_and_shared_experts_only_the_step_computes(tiny_checkpoints, family):
    # Qwen2-MoE: biased q/k/v and a sigmoid-gated shared expert beside the routed ones; OLMoE: q/k
    # norms over the whole projection; GLM-4-MoE: biased q/k/v, a rotary embedding over half of each
    # head, grouped sigmoid routing, a shared expert and a dense first layer. Their per-layer path
    # keeps transformers' attention (another summation order), so the two paths agree to bf16
    # rounding rather than bit for bit.
    from tests.helpers.numerics import close

    runtime = fast_runtime(str(tiny_checkpoints[family]))
    try:
        assert recognise(runtime.model) == ""
        whole, per_module = prefilled(runtime, PROMPT), prefilled(runtime, PROMPT)
        token = PROMPT[-1]
        with torch.inference_mode():
            for _ in range(6):
                step = Step(torch.tensor([[token]]), whole, whole.get_seq_length())
                assert runtime.whole_token.unavailable(step) is None
                ours = runtime.whole_token.run(step)
                reference = runtime.native_layers.run(
                    Step(torch.tensor([[token]]), per_module, per_module.get_seq_length()))
                close(ours, reference, f"{family} logits")
                token = int(reference[0, -1].argmax())
    finally:
        runtime.close()


def gpt_oss_checkpoint(kind: str, tiny_checkpoints, folder) -> str:
    from tests.helpers.gguf_writer import save_tiny_hf, write_gguf
    from tests.helpers.quantized_checkpoints import save_mxfp4_gpt_oss

    if kind == "bf16":
        return str(tiny_checkpoints["gpt_oss"])
    if kind == "mxfp4":
        return str(save_mxfp4_gpt_oss(folder / "mxfp4"))
    write_gguf(save_tiny_hf("gpt_oss", folder / "hf"), folder / "model.gguf", experts="MXFP4", dense="Q8_0")
    return str(folder / "model.gguf")


# bf16: transposed [in, out] expert matrices; MXFP4 (as published) and a GGUF file as llama.cpp's
# MXFP4_MOE writes it: experts in MXFP4 blocks, and in the GGUF the dense weights in Q8_0 too
@pytest.mark.parametrize("kind", ["bf16", "mxfp4", "gguf"])
def test_gpt_oss_past_its_sliding_window(tiny_checkpoints, tmp_path, kind):
    # GPT-OSS: attention sinks, biased q/k/v/o projections, eager attention's roundings, a sliding
    # window on every other layer, a router that soft-maxes its biased top k, clamped SwiGLU experts
    # with biases, and norms that round once. The tiny checkpoints' windows are 8-16 positions: the
    # reply runs well past them, so the sliding layers' caches drop positions while the step writes.
    runtime = fast_runtime(gpt_oss_checkpoint(kind, tiny_checkpoints, tmp_path))
    try:
        assert recognise(runtime.model) == ""
        window = runtime.model.config.sliding_window
        assert {type(layer).__name__ for layer in new_cache(runtime.model).layers} == {"BlockSlidingLayer", "BlockLayer"}
        assert_steps_match_the_module_path(runtime, PROMPT, 2 * window)
        reply = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=window + 4))
        assert len(reply.token_ids) > 1  # (a tiny random model may reach its end-of-text token early)
        assert runtime.decode_path == "fast: whole token in one native call"
    finally:
        runtime.close()


def latent_checkpoint(family: str, folder, **overrides) -> str:
    """A tiny checkpoint of a DeepSeek-V3-shaped family (the test suite's DeepSeek-V3 sizes)."""
    from tests.helpers.checkpoints import FAMILIES

    sizes = {k: v for k, v in FAMILIES["deepseek_v3"].items() if k != "model_type"}
    return str(save_tiny_checkpoint(family, folder / family, **(sizes | overrides)))


# DeepSeek-V3: multi-head latent attention (q through its LoRA and norm, or one q_proj; rotary pairs
# interleaved or in halves), grouped sigmoid routing with a correction bias and scaled weights, a
# shared expert beside the routed ones, and a dense first layer; GLM-4.7-Flash (glm4_moe_lite) the same
@pytest.mark.parametrize(("family", "overrides"), [
    ("deepseek_v3", {}),
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False}),
    ("glm4_moe_lite", {}),
], ids=["deepseek_v3", "deepseek_v3-no-q-lora", "glm4_moe_lite"])
def test_latent_attention_grouped_routing_and_dense_layers(tmp_path, family, overrides):
    runtime = fast_runtime(latent_checkpoint(family, tmp_path, **overrides))
    try:
        assert recognise(runtime.model) == ""
        with torch.no_grad():  # a correction bias that changes which experts are chosen
            for layer in runtime.model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
        # the latents and rotary keys it writes are the cache's keys and values
        assert_steps_match_the_module_path(runtime, PROMPT, 6)
        reply = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=6))
        assert len(reply.token_ids) > 1
        assert runtime.decode_path == "fast: whole token in one native call"
    finally:
        runtime.close()


def test_what_it_does_not_compute_is_declined_with_a_reason(tmp_path):
    # DeepSeek-V3 with biases on its attention's projections: the step's latent attention has none
    runtime = fast_runtime(latent_checkpoint("deepseek_v3", tmp_path, attention_bias=True))
    try:
        reason = recognise(runtime.model)  # a reason, in words
        assert reason == "layer 0: its latent attention's projections are not bias-free bf16 or block linears"
        Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=3))
        assert runtime.decode_path_reason == reason
    finally:
        runtime.close()

