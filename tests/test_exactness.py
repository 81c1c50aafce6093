"""Offloaded generation equals plain transformers, token for token, for every family, budget and store."""

from __future__ import annotations

import json

import pytest

from engine.cli.main import main as moescope
from tests.helpers.checkpoints import FAMILIES, reference_generate

PROMPT = [1, 17, 42, 9, 77, 5, 63, 30, 11]
NEW_TOKENS = 12


def run_generate(capsys, path, budget: str, store: str, *extra: str) -> dict:
    args = ["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--raw",
            "--max-new-tokens", str(NEW_TOKENS), "--store", store, "--json", *extra]
    if budget != "min":
        args += ["--budget", budget]
    else:
        args += ["--budget", "1"]  # one byte: clamped to the minimum, which the engine says on stderr
    code = moescope(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    if budget == "min":
        assert "below this model's minimum" in err
    return json.loads(out)


@pytest.fixture(scope="module")
def references(tiny_checkpoints) -> dict[str, list[int]]:
    return {family: reference_generate(path, PROMPT, NEW_TOKENS) for family, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("store", ["disk", "ram"])
@pytest.mark.parametrize("budget", ["min", "30%", "all"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(capsys, tiny_checkpoints, references, family, budget, store):
    result = run_generate(capsys, tiny_checkpoints[family], budget, store, "--exact")
    assert result["token_ids"] == references[family]
    stats = result["stats"]
    assert stats["decode_tokens"] == len(references[family])
    if budget == "all":
        assert stats["hit_rate"] == 1.0  # warmed at load: nothing left to fetch
    else:
        assert stats["misses"] > 0 and stats["bytes_loaded"] > 0


def test_teacher_forced_logits_equal_transformers_at_every_position(mixtral_checkpoint):
    # What bench.lossy_cost scores (KL, perplexity) comes through the engine's prompt path; offloaded
    # at 30 %, every position's logits still equal stock transformers' bit for bit.
    import torch
    from transformers import AutoModelForCausalLM

    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel

    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="30%", store="disk", device="cpu",
                                   fast_decode=False))
    try:
        ours = runtime.prompt_logits(PROMPT)
        assert runtime.counters.layer_misses.sum() > 0  # really offloaded
    finally:
        runtime.close()
    stock = AutoModelForCausalLM.from_pretrained(mixtral_checkpoint, dtype=torch.float32)
    with torch.inference_mode():
        theirs = stock(input_ids=torch.tensor([PROMPT])).logits[0]
    assert ours.shape == (len(PROMPT), stock.config.vocab_size)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe"])
def test_decode_tokens_through_the_grouped_experts_stay_exact(tiny_checkpoints, references, family):
    # On a GPU a decode token's resident experts run as grouped matmuls (fewer kernel launches); that path
    # is device-agnostic, so it is held to transformers here too, biases (gpt-oss) and shared experts included.
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints[family]), budget="all", store="ram", device="cpu",
                                   fast_decode=False))
    try:
        assert not runtime.cache.decode_grouped  # on a CPU, one-row matmuls straight from the slots
        runtime.cache.decode_grouped = True
        reply = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
        assert reply.token_ids == references[family]
    finally:
        runtime.close()


def test_repetition_penalty_matches_transformers(mixtral_checkpoint):
    # the sampler keeps the ids so far for the penalty only, in a buffer that outgrows its start
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    expected = reference_generate(mixtral_checkpoint, PROMPT, 80, generation_kwargs={"repetition_penalty": 1.5})
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="30%", store="disk"))
    try:
        settings = SamplingSettings(temperature=0, max_new_tokens=80, repetition_penalty=1.5)
        assert Generator(runtime).generate(PROMPT, settings).token_ids == expected
        plain = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=80)).token_ids
        assert plain != expected  # the penalty changed the reply
    finally:
        runtime.close()


def test_json_has_the_promised_stats(capsys, mixtral_checkpoint):
    stats = run_generate(capsys, mixtral_checkpoint, "30%", "disk")["stats"]
    for key in ("prefill_tokens", "decode_tokens", "ttft_s", "decode_tokens_per_s", "hit_rate", "bytes_loaded",
                "stall_s", "budget_bytes", "peak_rss_bytes"):
        assert key in stats
    assert stats["prefill_tokens"] == len(PROMPT)
    assert stats["peak_rss_bytes"] > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_decode_leaves_float32_models_exact(capsys, tiny_checkpoints, references, family):
    # The native kernels (the default) compute bf16 only; a float32 model decodes on transformers' kernels.
    import torch

    result = run_generate(capsys, tiny_checkpoints[family], "30%", "disk")
    assert result["token_ids"] == references[family]
    assert torch.backends.mkldnn.enabled  # the process-wide switch is restored after the reply


@pytest.fixture(scope="module")
def demo_chats() -> list[list[int]]:
    """Held-out demo questions, chat-encoded, whose greedy answers add up to more than 64 tokens."""
    from transformers import AutoTokenizer

    from engine.demo.corpus import SKILLS, heldout
    from resources import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    questions = [example.user for skill in SKILLS for example in heldout(skill, 2)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "default"])
@pytest.mark.parametrize("budget", ["25%", "all"])
def test_bf16_demo_answers_match_transformers_bf16(demo_chats, budget, fast):
    # The issue-10 bar for bf16: greedy tokens equal stock transformers in bf16, with --exact and by default
    # (its kernels sum in another order; on the demo model the tokens must still agree).
    import torch

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings
    from resources import DEMO_MODEL_DIR

    runtime = MoERuntime(LoadModel(path="demo", budget=budget, store="ram", dtype="bfloat16", fast_decode=fast))
    try:
        generator = Generator(runtime)
        ours = [generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=64)).token_ids for ids in demo_chats]
    finally:
        runtime.close()
    stock = [reference_generate(DEMO_MODEL_DIR, ids, 64, dtype=torch.bfloat16) for ids in demo_chats]
    assert sum(map(len, stock)) >= 64
    assert ours == stock


def test_bf16_packed_experts_stay_exact_across_budget_changes(demo_chats):
    # At budget `all` on CPU the bf16 expert matrices are kept packed for oneDNN (engine.offload.packed_linear)
    # where this CPU's oneDNN packs bf16 (AVX-512 or AVX-NE-CONVERT); a smaller budget unpacks them for good
    # (misses would pay for packing). No token may change.
    import torch

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.offload import packed_linear
    from engine.protocol import LoadModel, SamplingSettings
    from resources import DEMO_MODEL_DIR

    chats = demo_chats[:4]
    stock = [reference_generate(DEMO_MODEL_DIR, ids, 32, dtype=torch.bfloat16) for ids in chats]
    runtime = MoERuntime(LoadModel(path="demo", budget="all", store="disk", device="cpu", dtype="bfloat16",
                                   fast_decode=False))
    try:
        packs = packed_linear.available(torch.bfloat16)
        assert runtime.cache.packed_params == ({"gate_up_proj", "down_proj"} if packs else frozenset())
        generator = Generator(runtime)
        for budget, packed in (("all", packs), ("25%", False), ("1", False), ("all", False)):
            runtime.set_budget(budget)
            assert bool(runtime.cache.packed_params) is packed, budget
            ours = [generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=32)).token_ids for ids in chats]
            assert ours == stock, budget
    finally:
        runtime.close()


def test_bf16_switching_exact_off_unpacks_experts_and_keeps_answers(demo_chats):
    # Loaded --exact, then switched to the native kernels live: their experts kernel needs plain weights, the packed experts
    # are unpacked (for good), and the demo's greedy answers still equal transformers bf16.
    import torch

    from engine.decode.generation import Generator
    from engine.decode.native import kernels as decode_kernels
    from engine.decode.runtime import MoERuntime
    from engine.offload import packed_linear
    from engine.protocol import LoadModel, SamplingSettings
    from resources import DEMO_MODEL_DIR

    chats = demo_chats[:4]
    stock = [reference_generate(DEMO_MODEL_DIR, ids, 32, dtype=torch.bfloat16) for ids in chats]
    decode_kernels.load()
    runtime = MoERuntime(LoadModel(path="demo", budget="all", store="ram", device="cpu", dtype="bfloat16",
                                   fast_decode=False))
    try:
        packs = packed_linear.available(torch.bfloat16)  # this CPU's oneDNN packs bf16
        assert bool(runtime.cache.packed_params) is packs
        assert runtime.set_fast_decode(True)
        assert bool(runtime.cache.packed_params) is (packs and decode_kernels.failed())
        generator = Generator(runtime)
        assert [generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=32)).token_ids for ids in chats] == stock
    finally:
        runtime.close()
