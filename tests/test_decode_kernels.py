"""The native one-token kernels behind --fast-decode (engine/decode/native/src): they compute what
transformers' modules compute, to bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.numerics import close


@pytest.mark.parametrize("shape", [(1024, 1024), (300, 96), (17, 200)], ids=str)
def test_gemv_matches_linear(kernels, shape):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 1, shape[1], generator=generator).to(torch.bfloat16)
    y = kernels.gemv(kernels.Weight(weight), x)
    assert y.shape == (1, 1, shape[0]) and y.dtype == torch.bfloat16
    close(y, F.linear(x, weight), "gemv")


def test_rms_norm_matches_transformers(kernels):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(1, 1, 16, 64).to(torch.bfloat16) * 3  # q/k norms: one row per head
    y = kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert y.shape == x.shape
    close(y, norm(x), "rms_norm")


@pytest.mark.parametrize("picks", [[3, 60, 17, 0, 42, 5, 33, 8], [9, 2, 50]], ids=["whole-experts", "split-rows"])
def test_moe_decode_matches_the_expert_path(kernels, picks):
    # One token through some of 64 experts of a real transformers experts module, as the cache runs
    # it; 8 picks split whole experts between 2 threads, 3 split every matrix by rows.
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from engine.decode.modules.expert_recipe import experts_recipe
    from engine.offload.expert_compute import expert_mlp, weighted_sum

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=96, num_experts=64, num_experts_per_tok=8)
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.05)
        module.down_proj.normal_(0, 0.05)
    assert experts_recipe(module).plain
    slots = [{"gate_up_proj": module.gate_up_proj[e], "down_proj": module.down_proj[e]} for e in picks]
    hidden = torch.randn(1, 256).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(len(picks)), dim=0)
    reference = weighted_sum([expert_mlp(module, hidden, w) for w in slots], weights, torch.float32, torch.bfloat16)
    fused = kernels.moe_decode(hidden, [kernels.Weight(w["gate_up_proj"], 0, 256) for w in slots],
                               [kernels.Weight(w["down_proj"], 0, 96) for w in slots], weights)
    assert fused.shape == reference.shape and fused.dtype == torch.bfloat16
    close(fused, reference, "moe_decode")


def attention_module(family: str, **extra):
    """A bf16 attention module of a transformers family, its rotary embedding and config."""
    import importlib

    import transformers

    module_name, prefix = {"qwen3_moe": ("qwen3_moe", "Qwen3Moe"), "mixtral": ("mixtral", "Mixtral"),
                           "qwen2_moe": ("qwen2_moe", "Qwen2Moe"), "olmoe": ("olmoe", "Olmoe")}[family]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config = getattr(transformers, f"{prefix}Config")(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                                      head_dim=32, num_hidden_layers=1, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    module = getattr(modeling, f"{prefix}Attention")(config, 0).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)  # not all ones: the norm weights must be applied
    return module, getattr(modeling, f"{prefix}RotaryEmbedding")(config), config


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_attention_decode_step_matches_transformers(kernels, family):
    """A decode step of Llama-style attention in native calls: the same new key/value in the cache
    (bit for bit) and the same output as transformers' SDPA path, to bf16 rounding."""
    from transformers.cache_utils import DynamicCache

    from engine.decode.modules import native_modules
    from engine.model.cache_argument import cache_argument

    module, rotary, config = attention_module(family)
    caches = [DynamicCache(config=config), DynamicCache(config=config)]
    prompt = torch.randn(1, 40, 256).to(torch.bfloat16)
    token = torch.randn(1, 1, 256).to(torch.bfloat16)
    with torch.no_grad():
        for cache in caches:
            module(prompt, rotary(prompt, torch.arange(40)[None]), None, **cache_argument(module, cache))
        step = rotary(token, torch.tensor([[40]]))
        reference, _ = module(token, step, None, **cache_argument(module, caches[0]))
        switch = native_modules.NativeSwitch()
        assert native_modules.patch_module(module, switch) and type(module).__name__.startswith("Fast")
        with switch.active():
            ours, _ = module(token, step, None, **cache_argument(module, caches[1]))
    assert ours.shape == reference.shape == (1, 1, 256) and ours.dtype == torch.bfloat16
    close(ours, reference, f"{family} attention")
    assert torch.equal(caches[1].layers[0].keys, caches[0].layers[0].keys)
    assert torch.equal(caches[1].layers[0].values, caches[0].layers[0].values)


def test_attention_kernels_follow_the_cache_length(kernels):
    """attend() reads every cached position: a query that matches one key picks out its value."""
    keys = torch.zeros(1, 1, 300, 32)
    values = torch.arange(300).float().view(1, 1, 300, 1).expand(1, 1, 300, 32).contiguous()
    keys[0, 0, 200, 0] = 1.0  # the only key with a score: the softmax puts (nearly) all weight on it
    query = torch.zeros(1, 2, 1, 32)
    query[..., 0] = 40.0
    out = kernels.attend(query.to(torch.bfloat16), keys.to(torch.bfloat16), values.to(torch.bfloat16), 1.0)
    assert out.shape == (1, 1, 64)
    assert torch.allclose(out.float(), torch.full((1, 1, 64), 200.0), atol=1.0)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("length", [1, 15, 16, 47, 300])
@pytest.mark.parametrize("group", [2, 4, 8])
def test_attention_matches_float32_attention_for_any_length_and_head_size(variant, head_dim, length, group):
    """Keys are scored 16 (AVX-512) or 8 (AVX2) positions at a time where the head size allows, one
    at a time for the rest, and values summed 32 columns at a time, then 8; the query heads sharing
    a kv head go together (16 or 8 / group positions a step): in every build variant, every length,
    head size and group must give the float32 attention of the same bf16 inputs."""
    torch.manual_seed(head_dim + length + group)
    query = torch.randn(1, 2 * group, 1, head_dim).to(torch.bfloat16)
    keys = torch.randn(1, 2, length, head_dim).to(torch.bfloat16)
    values = torch.randn(1, 2, length, head_dim).to(torch.bfloat16)
    scale = head_dim ** -0.5
    grouped = [t.float().repeat_interleave(group, dim=1) for t in (keys, values)]
    weights = torch.softmax(query.float() @ grouped[0].transpose(-1, -2) * scale, dim=-1)
    reference = (weights @ grouped[1]).transpose(1, 2).reshape(1, 1, 2 * group * head_dim)
    ours = variant.attend(query, keys, values, scale)
    assert ours.shape == reference.shape
    assert torch.allclose(ours.float(), reference, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_decode_step_matches_transformers(kernels, family):
    """The router of one token with the native GEMV: the same experts, the same weights (to bf16
    rounding) and the same dtypes as transformers' router (Qwen3 casts to bf16, Mixtral keeps float32)."""
    import importlib

    import transformers

    from engine.decode.modules import native_modules

    prefix = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    extra = {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True} if family == "qwen3_moe" else {}
    config = getattr(transformers, f"{prefix}Config")(hidden_size=256, **extra)
    router = getattr(modeling, f"{prefix}TopKRouter")(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.2)
    token = torch.randn(1, 256).to(torch.bfloat16)
    with torch.no_grad():
        ref_logits, ref_weights, ref_index = router(token)
        switch = native_modules.NativeSwitch()
        assert native_modules.patch_module(router, switch)
        assert all(torch.equal(a, b) for a, b in zip(router(token), (ref_logits, ref_weights, ref_index), strict=True))
        with switch.active():
            logits, weights, index = router(token)
    assert torch.equal(index, ref_index)
    assert weights.dtype == ref_weights.dtype and logits.dtype == ref_logits.dtype
    close(weights, ref_weights, f"{family} router weights")
    close(logits, ref_logits, f"{family} router logits")


@pytest.mark.parametrize("family, extra", [("qwen2_moe", {}), ("olmoe", {})])
def test_other_attention_recipes_keep_their_code(family, extra):
    """Qwen2-MoE projects with biases, OLMoE norms the whole projection: not the native recipe."""
    from engine.decode.modules import native_modules

    module, _, _ = attention_module(family, **extra)
    assert not native_modules.patch_module(module, native_modules.NativeSwitch())
    assert not type(module).__name__.startswith("Fast")


def test_bad_shapes_are_refused_with_a_message(kernels):
    weight = torch.randn(8, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="one bf16 row"):
        kernels.gemv(kernels.Weight(weight), torch.randn(1, 17).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 CPU tensor"):
        kernels.gemv(kernels.Weight(weight.float()), torch.randn(1, 16).to(torch.bfloat16))
    query, keys = torch.zeros(1, 3, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="whole groups of heads"):
        kernels.attend(query, keys, keys, 1.0)  # 3 query heads cannot share 2 kv heads


@pytest.mark.parametrize("width,inter", [(256, 96), (250, 45)])
def test_gpt_oss_experts_run_on_the_kernel(kernels, width, inter):
    # GPT-OSS's experts: [in, out] matrices, biases, interleaved gate/up rows, the clamped SwiGLU
    # (with inputs beyond the clamp), and bf16 routing weights: the kernel computes what
    # transformers' own expert code computes. Also at sizes that leave rows and columns over after
    # the kernel's four-row, sixteen-column steps.
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine.decode.modules.expert_recipe import experts_recipe
    from engine.offload.expert_compute import expert_mlp, weighted_sum

    config = GptOssConfig(hidden_size=width, intermediate_size=inter, num_local_experts=4)
    config._experts_implementation = "eager"
    module = GptOssExperts(config).to(torch.bfloat16)
    torch.manual_seed(4)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    recipe = experts_recipe(module)
    assert recipe.transposed and recipe.bias and recipe.interleaved and recipe.clamped_swiglu
    slots = [{name: getattr(module, name)[e] for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                           "down_proj_bias")} for e in (2, 0, 3)]
    hidden = (torch.randn(1, width) * 2).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(3), dim=0).to(torch.bfloat16)
    reference = weighted_sum([expert_mlp(module, hidden, w) for w in slots], weights, torch.bfloat16, torch.bfloat16)
    gate = kernels.GateRecipe(True, True, recipe.alpha, recipe.limit)
    fused = kernels.moe_decode(hidden, [kernels.Weight(w["gate_up_proj"], 0, 2 * inter) for w in slots],
                               [kernels.Weight(w["down_proj"], 0, width) for w in slots], weights,
                               [w["gate_up_proj_bias"] for w in slots], [w["down_proj_bias"] for w in slots], True, gate)
    assert fused.shape == reference.shape and fused.dtype == torch.bfloat16
    close(fused, reference, "moe_decode (GPT-OSS)")
