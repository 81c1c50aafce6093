"""Which families take which decode path, decided by their classes (engine.decode.modules.families).

The table of classes is checked two ways: every listed class computes, on its native kernel, what
its own transformers forward computes (to bf16 rounding), and tiny checkpoints of the families
the suite builds take the path pinned here. A transformers release that changes one of these
forwards fails the first check instead of silently switching a path off or computing otherwise.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import PreTrainedConfig

from engine.decode.generation import Generator
from engine.decode.kv_cache import new_cache
from engine.decode.modules import expert_recipe, families, native_experts, native_modules
from engine.decode.paths.base import Step
from engine.decode.runtime import MoERuntime
from engine.model.cache_argument import cache_argument
from engine.offload.expert_compute import torch_one_token
from engine.protocol import LoadModel, SamplingSettings
from tests.helpers.checkpoints import make_config
from tests.helpers.numerics import close

pytestmark = pytest.mark.usefixtures("kernels")

WHOLE = "fast: whole token in one native call"
LAYERS = "fast: native kernels, layer by layer"
NOT_THESE = ("the whole-token step runs Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3, GLM-4.5 "
             "and GLM-4.7-Flash decoders only")

# family -> (the path a decode token takes at budget all, which module kinds run natively)
PINNED = {
    "demo": (WHOLE, {"norm", "attention", "router"}),  # the demo model is a Qwen3-MoE
    "mixtral": (WHOLE, {"norm", "attention", "router"}),
    "qwen2_moe": (WHOLE, {"norm", "router"}),  # per layer, its biased q/k/v keep their own code
    "olmoe": (WHOLE, {"norm", "router"}),  # per layer, its full-width q/k norms keep their own code
    "deepseek_v3": (WHOLE, {"norm", "attention"}),  # MLA absorbed; grouped routing only in the step
    "glm4_moe": (WHOLE, {"norm"}),  # partial rotary, biased q/k/v, grouped routing: only in the step
    "gpt_oss": (WHOLE, {"norm", "attention", "router"}),  # sinks, biases, windows, interleaved experts
}
# Families whose experts are gated MLPs: the native experts kernel computes them in the per-layer path
# (engine.decode.modules.expert_recipe), whatever the rest of the decoder takes.
GATED_EXPERTS = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"]


def listed(kind: str) -> list[type]:
    return sorted({"norm": families.listed("norms"), "attention": families.listed("attention"),
                   "router": families.router_recipes()}[kind], key=lambda cls: cls.__name__)


def config_of(cls: type, **values) -> PreTrainedConfig:
    """The family's text config class, from the module that defines `cls`."""
    configs = [v for v in vars(inspect.getmodule(cls)).values()
               if isinstance(v, type) and issubclass(v, PreTrainedConfig) and v is not PreTrainedConfig]
    text = [c for c in configs if "Text" in c.__name__]
    return (text or configs)[0](**values)


def test_every_listed_class_is_in_this_transformers():
    for family in families.FAMILIES:
        for names in (family.norms, family.attention, [name for name, _ in family.routers], family.whole_token or ()):
            assert len(families._classes(family, names)) == len(names), f"{family.module}: {names}"


@pytest.mark.parametrize("cls", listed("norm"), ids=lambda cls: cls.__name__)
def test_listed_norms_compute_what_the_native_norm_computes(kernels, cls):
    torch.manual_seed(0)
    norm = cls(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    once = families.norm_rounds_once(norm)
    assert families.is_llama_rms_norm(norm, rounding_once=True)
    assert families.is_llama_rms_norm(norm) != once  # the whole-token step computes Llama's rounding only
    x = (torch.randn(1, 3, 64) * 3).to(torch.bfloat16)
    ours, reference = kernels.rms_norm(x, norm.weight, norm.variance_epsilon, once), norm(x)
    close(ours, reference, cls.__name__)
    # the same roundings: all but the odd element (the mean of squares is summed in another order)
    assert (ours == reference).float().mean() >= 0.95, cls.__name__


@pytest.mark.parametrize("cls", listed("router"), ids=lambda cls: cls.__name__)
def test_listed_routers_pick_what_their_own_forward_picks(cls):
    torch.manual_seed(1)
    config = config_of(cls, hidden_size=64, num_experts=16, num_local_experts=16, num_experts_per_tok=4,
                       norm_topk_prob=True)
    router = cls(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
    token = torch.randn(1, 64).to(torch.bfloat16)
    with torch.no_grad():
        reference = router(token)
        switch = native_modules.NativeSwitch()
        assert native_modules.patch_module(router, switch)
        with switch.active():
            ours = router(token)
    assert torch.equal(ours[2], reference[2]), "the same experts"
    assert [t.dtype for t in ours] == [t.dtype for t in reference]
    close(ours[1], reference[1], f"{cls.__name__} weights")


def step_like_own_forward(module: torch.nn.Module, config, rotary, what: str):
    """A 24-token prompt, then one token through the module's own forward and, patched, inside a
    native step: the outputs agree to bf16 rounding. Returns both caches (own, native)."""
    from transformers.cache_utils import DynamicCache

    prompt, token = torch.randn(1, 24, 256).to(torch.bfloat16), torch.randn(1, 1, 256).to(torch.bfloat16)
    caches = [DynamicCache(config=config), DynamicCache(config=config)]
    with torch.no_grad():
        for cache in caches:
            module(hidden_states=prompt, position_embeddings=rotary(prompt, torch.arange(24)[None]),
                   attention_mask=None, **cache_argument(module, cache))
        step = rotary(token, torch.tensor([[24]]))
        # by keyword, as decoder layers call them: families order the arguments differently
        reference, _ = module(hidden_states=token, position_embeddings=step, attention_mask=None,
                              **cache_argument(module, caches[0]))
        switch = native_modules.NativeSwitch()
        assert native_modules.patch_module(module, switch)
        with switch.active():
            ours, _ = module(hidden_states=token, position_embeddings=step, attention_mask=None,
                             **cache_argument(module, caches[1]))
    close(ours, reference, what)
    return caches[0], caches[1]


@pytest.mark.parametrize("bias", [False, True], ids=["bias-free", "biased"])
@pytest.mark.parametrize("cls", listed("attention"), ids=lambda cls: cls.__name__)
def test_listed_attention_steps_like_its_own_forward(cls, bias):
    config = config_of(cls, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                       num_hidden_layers=1, attention_bias=bias, attention_dropout=0.0)
    torch.manual_seed(2)
    module = cls(config, 0)
    sinks = getattr(module, "sinks", None)
    # GPT-OSS's sinks are computed by its eager function only (its SDPA would drop them): the native
    # step then rounds as that function does
    config._attn_implementation = "eager" if sinks is not None else "sdpa"
    with torch.no_grad():
        if sinks is not None:
            sinks.normal_(0, 2)
        for proj in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
            if proj.bias is not None:
                proj.bias.normal_(0, 0.5)
    module = module.to(torch.bfloat16).eval()
    assert families.is_llama_attention(module), "it qualifies, biased or not"
    rotary_module = next(v for v in vars(inspect.getmodule(cls)).values()
                         if isinstance(v, type) and v.__name__.endswith("RotaryEmbedding"))(config)

    def rotary(x, positions):  # families with several attention kinds name the one (Mellum)
        if "layer_type" in inspect.signature(rotary_module.forward).parameters:
            return rotary_module(x, positions, layer_type=config.layer_types[0])
        return rotary_module(x, positions)

    step_like_own_forward(module, config, rotary, cls.__name__)


@pytest.mark.parametrize("window", [None, 6])
def test_one_query_eager_attention_with_sinks_and_mask_is_the_familys_own(window):
    # GPT-OSS's eager attention: grouped kv heads, attention sinks, an additive (sliding-window) mask
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

    from engine.decode.modules import one_query_attention
    from engine.decode.modules.switch import SWITCH_ATTR

    config = GptOssConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(5)
    module = GptOssAttention(config, 0).to(torch.bfloat16).eval()
    with torch.no_grad():
        module.sinks.normal_(0, 2)
    query = torch.randn(1, 8, 1, 16).to(torch.bfloat16)
    key, value = torch.randn(1, 2, 20, 16).to(torch.bfloat16), torch.randn(1, 2, 20, 16).to(torch.bfloat16)
    mask = torch.zeros(1, 1, 1, 20)
    if window:
        mask[..., :-window] = torch.finfo(torch.float32).min
    mask = mask.to(torch.bfloat16)
    switch = native_modules.NativeSwitch()
    module.__dict__[SWITCH_ATTR] = switch
    reference, _ = eager_attention_forward(module, query, key, value, mask, scaling=module.scaling, s_aux=module.sinks)
    with switch.active():
        ours, weights = one_query_attention.eager_attention(module, query, key, value, mask, scaling=module.scaling,
                                                            s_aux=module.sinks)
    assert weights is None  # the one-query path ran (the family's own returns its weights)
    close(ours, reference, f"GPT-OSS eager attention, window {window}")
    outside, _ = one_query_attention.eager_attention(module, query, key, value, mask, scaling=module.scaling,
                                                     s_aux=module.sinks)
    assert torch.equal(outside, reference)  # outside a native step: the family's own function
    with switch.active():  # a keyword the one-query path does not compute: the family's own function
        capped, weights = one_query_attention.eager_attention(module, query, key, value, mask, scaling=module.scaling,
                                                              s_aux=module.sinks, softcap=30.0)
    assert weights is not None and torch.equal(capped, reference)


@pytest.mark.parametrize("in_torch", [False, True], ids=["native", "torch"])
@pytest.mark.parametrize("q_lora_rank", [48, None])
@pytest.mark.parametrize("cls", sorted(families.listed("latent_attention"), key=lambda c: c.__name__),
                         ids=lambda cls: cls.__name__)
def test_listed_latent_attention_steps_like_its_own_forward(kernels, monkeypatch, cls, q_lora_rank, in_torch):
    # MLA with kv_b_proj absorbed gives what the module's own forward gives after expanding the
    # whole latent cache, and leaves the cache as that forward leaves it: in the native kernel, and
    # in torch (before the kernels are built).
    from engine.decode.modules import latent_attention

    if in_torch:
        monkeypatch.setattr(latent_attention.native, "ready", lambda: None)
    config = config_of(cls, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=q_lora_rank,
                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, head_dim=16,
                       num_hidden_layers=1, attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(2)
    module = cls(config, 0).to(torch.bfloat16).eval()
    assert families.is_latent_attention(module)
    rotary = next(v for v in vars(inspect.getmodule(cls)).values()
                  if isinstance(v, type) and v.__name__.endswith("RotaryEmbedding"))(config)
    theirs, ours = step_like_own_forward(module, config, rotary, cls.__name__)
    assert all(torch.equal(a, b) for a, b in zip(theirs.layers[0].keys, ours.layers[0].keys, strict=True))


def native_attention(module: torch.nn.Module) -> bool:
    return families.is_llama_attention(module) or families.is_latent_attention(module)


def native_kinds(runtime: MoERuntime) -> set[str]:
    kinds = set()
    for module in runtime.model.modules():
        cls = type(module)
        if cls is native_modules.FastLinear or not getattr(cls, "_moescope_plain", None):
            continue
        kinds |= {kind for kind, test in (("norm", lambda m: families.is_llama_rms_norm(m, rounding_once=True)),
                                          ("attention", native_attention),
                                          ("router", lambda m: families.router_recipe(m) is not None)) if test(module)}
    return kinds


@pytest.mark.parametrize("family", sorted(PINNED))
def test_each_family_takes_its_pinned_path(tiny_checkpoints, family):
    path = "demo" if family == "demo" else str(tiny_checkpoints[family])
    runtime = MoERuntime(LoadModel(path=path, budget="all", store="ram", device="cpu", dtype="bfloat16",
                                   fast_decode=True))
    try:
        kv = new_cache(runtime.model)
        prompt = torch.tensor([[5, 17, 33, 8, 61]])
        with torch.inference_mode():
            runtime.paths.choose(Step(prompt, kv, 0))[0].run(Step(prompt, kv, 0))  # the prefill
            step = Step(torch.tensor([[9]]), kv, prompt.shape[1])
            path, reason = runtime.paths.choose(step)
            label, kinds = PINNED[family]
            assert path.label == label
            assert reason == ("" if label == WHOLE else NOT_THESE)  # said, in the System panel's tooltip
            assert path.run(step).shape[:2] == (1, 1)
        assert native_kinds(runtime) == kinds
        # SDPA and eager attention alike (GPT-OSS's, with sinks) go through the one-query functions
        assert runtime.model.config._attn_implementation in ("moescope_sdpa", "moescope_eager")
    finally:
        runtime.close()


def fast_runtime(path) -> MoERuntime:
    """Budget all with the native kernels, which are the CPU's (on a GPU machine too)."""
    return MoERuntime(LoadModel(path=str(path), budget="all", store="ram", device="cpu", dtype="bfloat16",
                                   fast_decode=True))


def experts_modules(runtime: MoERuntime) -> list[torch.nn.Module]:
    return [m for m in runtime.model.modules() if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj")]


@pytest.mark.parametrize("family", GATED_EXPERTS)
def test_gated_experts_run_on_the_native_kernel(kernels, tiny_checkpoints, family):
    # Every layer's experts (biased, interleaved or transposed alike) are recognised, and the
    # kernel gives what transformers' own one-token experts give, from the very slots the cache holds.
    runtime = fast_runtime(tiny_checkpoints[family])
    try:
        modules = experts_modules(runtime)
        assert modules and all(expert_recipe.experts_problem(m) == "" for m in modules)
        cache, native = runtime.cache, native_experts.NativeExperts(kernels)
        torch.manual_seed(3)
        for layer, module in zip(range(len(cache.slot_views)), modules, strict=False):
            slots = cache.slot_views[layer]
            chosen = [slots[cache.directory.slot_of[layer][e]] for e in (3, 0, 5)]
            hidden = (torch.randn(1, runtime.model.config.hidden_size) * 2).to(torch.bfloat16)
            for weights in (torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.5, 0.3, 0.2]).to(torch.bfloat16)):
                out_dtype = torch.promote_types(torch.bfloat16, weights.dtype)
                reference = torch_one_token(module, hidden, chosen, weights, out_dtype, cache.reader)
                ours = native(module, hidden, chosen, weights, out_dtype, cache.reader)
                assert ours.dtype == reference.dtype
                close(ours, reference, f"{family} layer {layer}")
    finally:
        runtime.close()


PROMPT = [5, 17, 33, 8, 61, 12, 40, 9, 27, 4]


# Random tiny routers and heads meet near-ties (two logits one bf16 step apart) within 64 tokens,
# where any other summation order may pick the other token: the replies must be equal up to the
# first such near-tie (OLMoE's and GLM-4-MoE's random routers part too early to say much; their
# experts kernel is checked above).
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_greedy_replies_equal_transformers(tiny_checkpoints, tmp_path, family):
    from tests.helpers.checkpoints import first_parting_is_a_near_tie, reference_with_margins, save_tiny_checkpoint

    path = save_tiny_checkpoint(family, tmp_path / family, eos_token_id=None)  # 64 tokens, no early stop
    # A prompt this short runs as the whole-token step's rows (tests/test_whole_token_prompt.py), where
    # DeepSeek-V3's random grouped router flips a group within it (a near-tie of the router, not of the
    # reply's logits): its prompt is made longer than the step's rows, so the prompt path reads it as
    # transformers does and what may part is the decode.
    prompt = PROMPT * 2 if family == "deepseek_v3" else PROMPT
    runtime = fast_runtime(path)
    try:
        reply = Generator(runtime).generate(prompt, SamplingSettings(temperature=0, max_new_tokens=64))
        assert runtime.decode_path == PINNED[family][0]
    finally:
        runtime.close()
    reference, logits = reference_with_margins(path, prompt, 64, dtype=torch.bfloat16)
    assert first_parting_is_a_near_tie(reply.token_ids, reference, logits)


def test_experts_the_kernel_does_not_compute_say_why():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(make_config("qwen2_moe", hidden_act="gelu"))
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    assert expert_recipe.experts_problem(experts) == "experts use act GELUActivation; the native kernel computes SiLU"

    model = AutoModelForCausalLM.from_config(make_config("gpt_oss"))
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    assert expert_recipe.experts_recipe(experts).clamped_swiglu
    other = type("OtherGate", (type(experts),), {"_apply_gate": lambda self, gate_up: gate_up[..., ::2] * 2})
    experts.__class__ = other
    experts.__dict__.pop("_moescope_recipe")
    assert expert_recipe.experts_problem(experts) == (
        "OtherGate's own gate (_apply_gate) is not the clamped SwiGLU the native kernel computes")
