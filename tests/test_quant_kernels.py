"""The native kernels on block-quantized weights: they dequantize to the reference's very values
(engine.formats.dequantize, itself the gguf package's), and their products equal the bf16 product
with the dequantized matrix to float32 summation order — in every variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.decode.native import kernels as native
from engine.decode.native.testing import forced_paths
from engine.formats.blocks import FORMATS, K_QUANTS, checkpoint_format
from engine.formats.dequantize import dequantize
from engine.formats.quantize import quantize
from engine.formats.relay import fp8_from_tiles
from tests.helpers.numerics import close

pytestmark = pytest.mark.kernels


# every block format, and FP8 checkpoints' own row blocks
KERNEL_FORMATS = [*sorted(FORMATS), "fp8"]


def quantized(fmt_name: str, rows: int = 40, columns: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [rows, row bytes], the reference's bf16 values [rows, columns])."""
    fmt = checkpoint_format(fmt_name)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, columns)) * 0.05).astype(np.float32)
    x[1] = 0.0
    x[2, :32] = 1.5  # a block far from the others
    if fmt_name == "fp8":  # as FP8 checkpoints are made: e4m3 per 128x128 tile of one float32 scale
        weight = torch.from_numpy(x)
        tiles = weight.abs().reshape(-(-rows // 128), -1, columns // 128, 128).amax(dim=(1, 3)).clamp(min=1e-12) / 448
        full = tiles.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)
        e4m3 = (weight / full).to(torch.float8_e4m3fn)
        packed = torch.empty(rows, fmt.row_bytes(columns), dtype=torch.uint8)
        fp8_from_tiles(e4m3.view(torch.uint8), tiles, packed)
    else:
        packed = torch.from_numpy(quantize(x, fmt))
    return packed, dequantize(packed, fmt, columns, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bf16", "float32-of-bf16", "float32"])
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_native_dequantization_is_the_reference_bit_for_bit(variant, name, dtype):
    # float32-of-bf16: what the prompt tiles expand a matrix into where the CPU has no bf16 dot
    # products; float32: a float32 model's dequantized experts (the demo's), never rounded to bf16
    packed, reference = quantized(name)
    fmt, columns = checkpoint_format(name), reference.shape[1]
    if dtype == "float32":
        reference = dequantize(packed, fmt, columns, torch.float32)
    out = torch.empty(reference.shape, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    variant.dequantize(native.weight(variant, packed, fmt, columns), out, bf16_values=dtype == "float32-of-bf16")
    assert torch.equal(out.float().view(torch.int32), reference.float().view(torch.int32))


def test_mxfp4_at_every_block_exponent_is_the_reference(variant):
    # the AVX-512 path adds the block scale to the bf16 exponent field, which holds only where the
    # weights stay normal: every exponent byte, including those that make them subnormal or infinite
    fmt = checkpoint_format("mxfp4")
    rng = np.random.default_rng(5)
    packed = torch.from_numpy(rng.integers(0, 256, (256, 2 * 17), dtype=np.uint8))
    packed[:, 0] = packed[:, 17] = torch.arange(256, dtype=torch.uint8)
    reference = dequantize(packed, fmt, 64, torch.bfloat16)
    out = torch.empty_like(reference)
    variant.dequantize(native.weight(variant, packed, fmt, 64), out)
    assert torch.equal(out.view(torch.int16), reference.view(torch.int16))
    x = (torch.randn(1, 64, generator=torch.Generator().manual_seed(5)) * 0.5).to(torch.bfloat16)
    # rows whose products stay normal floats (AVX-512 BF16's dot products flush subnormal ones to zero,
    # which on the rows scaled by 2^-126 cost more than 1 %) and whose sums stay finite
    normal = slice(8, 201)
    ours = variant.gemv(native.weight(variant, packed[normal], fmt, 64), x).float()[0]
    exact = (x.double() @ reference[normal].double().t())[0]
    row_scale = x.double().abs().sum() * reference[normal].double().abs().amax(dim=1)  # each row's own magnitude
    assert ((ours.double() - exact).abs() <= 0.01 * row_scale).all()


@pytest.mark.parametrize("name", KERNEL_FORMATS)
@pytest.mark.parametrize("integer", [True, False], ids=["integer-dots", "float-loops"])
def test_quantized_gemv_is_the_dequantized_bf16_product(variant, name, integer):
    # integer dots (dots/fixed_input.h, the default where a type has one) and the reference-exact float loops
    packed, reference = quantized(name, rows=300, columns=1024, seed=2)
    x = (torch.randn(1, 1024) * 0.5).to(torch.bfloat16)
    x[0, :7] = torch.tensor([3.0, -3.0, 1e-3, -1e-3, 0.0, 2.5, -2.99])  # extremes of the fixed-point planes
    with forced_paths(variant, integer_dots=integer):
        ours = variant.gemv(native.weight(variant, packed, checkpoint_format(name), 1024), x)
    assert ours.shape == (1, 300) and ours.dtype == torch.bfloat16
    close(ours, F.linear(x, reference), f"{name} gemv")
    exact = x.double() @ reference.double().t()  # the same products, summed exactly
    assert (ours.double() - exact).abs().max() <= 0.01 * exact.abs().max()


@pytest.mark.parametrize("name", ["mxfp4", "q8_0", "q4_0", "q5_0"])
@pytest.mark.parametrize("columns", [96, 2880])
def test_gemv_rows_that_end_inside_an_input_chunk(variant, name, columns):
    # the input's fixed point is scaled per 256 elements, and 32-element blocks need not fill the
    # last chunk: gpt-oss's 2880 columns end 64 elements into one, 96 is an odd number of blocks
    packed, reference = quantized(name, rows=40, columns=columns, seed=6)
    x = (torch.randn(1, columns) * 0.5).to(torch.bfloat16)
    ours = variant.gemv(native.weight(variant, packed, checkpoint_format(name), columns), x)
    close(ours, F.linear(x, reference), f"{name} gemv over {columns} columns")
    exact = x.double() @ reference.double().t()
    assert (ours.double() - exact).abs().max() <= 0.01 * exact.abs().max()


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_rows_times_a_quantized_matrix_is_the_dequantized_bf16_product(variant, name):
    # a prompt's rows through one expert matrix (linear_rows): tiles of the matrix expanded in L1,
    # any number of rows and a matrix height that is no multiple of the tile
    packed, reference = quantized(name, rows=258, columns=512, seed=3)
    weight = native.weight(variant, packed, checkpoint_format(name), 512)
    bias = (torch.randn(258) * 0.1).to(torch.bfloat16)
    for rows in (1, 5, 16):
        x = (torch.randn(rows, 512) * 0.5).to(torch.bfloat16)
        ours = variant.linear_rows(weight, x)
        assert ours.shape == (rows, 258) and ours.dtype == torch.bfloat16
        close(ours, F.linear(x, reference), f"{name} x {rows} rows")
        exact = x.double() @ reference.double().t()
        assert (ours.double() - exact).abs().max() <= 0.01 * exact.abs().max()
        close(variant.linear_rows(weight, x, bias), F.linear(x, reference, bias), f"{name} with a bias")


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q6_k", "q3_k", "q2_k", "q5_0", "mxfp4", "fp8"])
@pytest.mark.parametrize("seed", [0, 4])
def test_quantized_experts_in_one_call(variant, name, seed):
    # One token through 8 quantized experts of [2I, H] / [H, I], weighted and summed, set against
    # the same computation in float32 on the float32 dequantized weights. The reference the
    # engine's exact path computes (bf16 weights, transformers' bf16 roundings) is itself some way
    # from it, and the integer dots (which skip rounding the weights to bf16) must be no further.
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from engine.formats.dequantize import dequantize
    from engine.offload.expert_compute import expert_mlp, weighted_sum

    hidden, inter, fmt = 512, 256, checkpoint_format(name)
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=8, num_experts_per_tok=8)
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    experts = []
    for e in range(8):
        gate_up, _ = quantized(name, 2 * inter, hidden, seed=10 + e)
        down, _ = quantized(name, hidden, inter, seed=20 + e)
        experts.append((gate_up, down))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=generator).to(torch.bfloat16)
    route = torch.softmax(torch.randn(8, generator=generator), dim=0)

    def through_torch(dtype: torch.dtype) -> torch.Tensor:
        outputs = [expert_mlp(module.to(dtype), x.to(dtype), {"gate_up_proj": dequantize(g, fmt, hidden, dtype),
                                                               "down_proj": dequantize(d, fmt, inter, dtype)})
                   for g, d in experts]
        return weighted_sum(outputs, route, torch.float32, dtype).float()

    truth, reference = through_torch(torch.float32), through_torch(torch.bfloat16)
    for integer in (True, False):
        with forced_paths(variant, integer_dots=integer):
            ours = variant.moe_decode(x, [native.weight(variant, g, fmt, hidden) for g, _ in experts],
                                      [native.weight(variant, d, fmt, inter) for _, d in experts], route).float()
        scale = truth.abs().max()
        assert (ours - truth).abs().max() <= 2 * (reference - truth).abs().max() + 0.01 * scale, (name, integer)
        if not integer:
            close(ours, reference, f"{name} experts")  # the float loops: the reference's own values


def test_forced_paths_come_back_to_the_default_when_the_block_raises():
    switched = []

    class Recorder:
        def _set_integer_dots(self, on: bool) -> None:
            switched.append(("integer_dots", on))

        def _set_amx(self, on: bool) -> None:
            switched.append(("amx", on))

    with pytest.raises(RuntimeError), forced_paths(Recorder(), integer_dots=False, amx=False):
        raise RuntimeError("a failing test")
    assert switched == [("integer_dots", False), ("amx", False), ("integer_dots", True), ("amx", True)]
    switched.clear()
    with forced_paths(Recorder(), amx=False):  # a switch not named is left alone
        pass
    assert switched == [("amx", False), ("amx", True)]


def test_a_matrix_that_does_not_match_its_type_is_refused(variant):
    packed, _ = quantized("q4_k")
    with pytest.raises(RuntimeError, match="columns do not match"):
        variant.gemv(native.weight(variant, packed, FORMATS["q4_k"], 256), torch.zeros(1, 256, dtype=torch.bfloat16))


def test_gpt_oss_experts_in_one_call(variant):
    # gpt-oss's experts (biases, interleaved gate/up, clamped SwiGLU) on MXFP4 slots, one call,
    # against transformers' recipe on the same weights dequantized to bf16 (the engine's exact path)
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine.decode.modules.expert_recipe import ExpertsRecipe, experts_recipe
    from engine.decode.modules.native_experts import NativeExperts
    from engine.offload.expert_compute import SlotReader, torch_one_token

    hidden, inter, fmt = 256, 128, checkpoint_format("mxfp4")
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=4, num_experts_per_tok=4)
    module = GptOssExperts(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    chosen = []
    for e in range(4):
        chosen.append({"gate_up_proj": quantized("mxfp4", 2 * inter, hidden, seed=30 + e)[0],
                       "gate_up_proj_bias": (torch.randn(2 * inter, generator=generator) * 0.1).to(torch.bfloat16),
                       "down_proj": quantized("mxfp4", hidden, inter, seed=40 + e)[0],
                       "down_proj_bias": (torch.randn(hidden, generator=generator) * 0.1).to(torch.bfloat16)})
    from engine.model.layout import ExpertParam

    params = [ExpertParam("gate_up_proj", (hidden, 2 * inter), torch.uint8, 0, 0, fmt, True),
              ExpertParam("down_proj", (inter, hidden), torch.uint8, 0, 0, fmt, True)]
    reader = SlotReader(params, torch.bfloat16)
    recipe = experts_recipe(module)  # the native kernel runs them, not torch's
    assert isinstance(recipe, ExpertsRecipe) and recipe.clamped_swiglu
    x = (torch.randn(1, hidden, generator=generator) * 2).to(torch.bfloat16)
    route = torch.softmax(torch.randn(4, generator=generator), dim=0).to(torch.bfloat16)
    reference = torch_one_token(module, x, chosen, route, torch.bfloat16, reader)
    with forced_paths(variant, integer_dots=False):  # the float loops: the reference's weights, summed in another order
        ours = NativeExperts(variant)(module, x, chosen, route, torch.bfloat16, reader)
    close(ours, reference, "gpt-oss experts")
    ours_int = NativeExperts(variant)(module, x, chosen, route, torch.bfloat16, reader)
    assert (ours_int.float() - reference.float()).abs().max() <= 0.05 * reference.float().abs().max()


@pytest.mark.parametrize(("family", "name"), [("qwen3_moe", "q4_k"), ("qwen3_moe", "q8_0"), ("qwen3_moe", "q6_k"),
                                              ("qwen3_moe", "original"), ("gpt_oss", "mxfp4")])
def test_a_prompts_rows_through_a_layers_experts_in_one_call(variant, family, name):
    # A prompt's rows sorted by expert (as the expert cache gathers them) through a layer's resident
    # experts in one native call (moe_prompt): every expert's rows equal transformers' recipe on the
    # same weights dequantized to bf16, to summation order; experts with 0, 1 and a count that is no
    # multiple of the kernel's 4-row (16 on AMX) tiles (1 and 3: few enough for the integer dots, the
    # others on tiles); gpt-oss's biases, interleaved gate/up and clamped SwiGLU.
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from engine.decode.modules.native_experts import NativePromptExperts
    from engine.model.layout import ExpertParam
    from engine.offload.expert_compute import SlotReader, expert_mlp

    # an odd width on bf16 weights: a lone last gate/up pair, and sums past the last 32 columns
    hidden, inter = 256, {"original": 97, "q8_0": 96, "mxfp4": 96}.get(name, 256)
    counts = [5, 0, 16, 1, 7, 3, 40]  # 40: three blocks of rows on AMX tiles, then more
    if family == "gpt_oss":
        module = GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=6,
                                            num_experts_per_tok=2))
    else:
        module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=6,
                                                num_experts_per_tok=2))
    module = module.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    fmt = None if name == "original" else checkpoint_format(name)
    chosen = []
    for e in range(len(counts)):
        if fmt is None:
            expert = {"gate_up_proj": (torch.randn(2 * inter, hidden, generator=generator) * 0.05).to(torch.bfloat16),
                      "down_proj": (torch.randn(hidden, inter, generator=generator) * 0.05).to(torch.bfloat16)}
        else:
            expert = {"gate_up_proj": quantized(name, 2 * inter, hidden, seed=50 + e)[0],
                      "down_proj": quantized(name, hidden, inter, seed=60 + e)[0]}
        if module.has_bias:
            expert["gate_up_proj_bias"] = (torch.randn(2 * inter, generator=generator) * 0.1).to(torch.bfloat16)
            expert["down_proj_bias"] = (torch.randn(hidden, generator=generator) * 0.1).to(torch.bfloat16)
        chosen.append(expert)
    transposed = module.is_transposed  # gpt-oss reads x @ W; its quantized slots still hold [out, in] blocks
    shapes = ((hidden, 2 * inter), (inter, hidden)) if transposed else ((2 * inter, hidden), (hidden, inter))
    params = [] if fmt is None else [
        ExpertParam("gate_up_proj", shapes[0], torch.uint8, 0, 0, fmt, transposed),
        ExpertParam("down_proj", shapes[1], torch.uint8, 0, 0, fmt, transposed)]
    reader = SlotReader(params, torch.bfloat16)
    rows = (torch.randn(sum(counts), hidden, generator=generator) * 2).to(torch.bfloat16)
    start = [sum(counts[:e]) for e in range(len(counts))]
    ours = NativePromptExperts(variant)(module, rows, start, counts, chosen, reader)
    assert ours is not None and ours.shape == rows.shape and ours.dtype == torch.bfloat16
    for e, (first, count) in enumerate(zip(start, counts, strict=True)):
        if count == 0:
            continue
        part = slice(first, first + count)
        reference = expert_mlp(module, rows[part], reader.plain(chosen[e]))
        close(ours[part], reference, f"{family} {name} expert {e} ({count} rows)")


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_expert_outputs_are_summed_as_the_expert_cache_sums_them(variant, weights_dtype):
    # combine_rows (the fast prompt's weighting, scatter and sum in one pass) gives the expert cache's
    # torch ops bit for bit, with float32 routing weights (Mixtral) and bf16 ones (Qwen3-MoE)
    built = variant
    generator = torch.Generator().manual_seed(2)
    for tokens, top_k, hidden in ((37, 8, 96), (16, 2, 1024)):
        y = (torch.randn(tokens * top_k, hidden, generator=generator) * 3).to(torch.bfloat16)
        weights = torch.rand(tokens * top_k, 1, generator=generator).to(weights_dtype)
        order = torch.randperm(tokens * top_k, generator=generator)
        out_dtype = torch.promote_types(torch.bfloat16, weights_dtype)
        outputs, scattered = torch.mul(y, weights).to(out_dtype), torch.empty(tokens * top_k, hidden, dtype=out_dtype)
        scattered.index_copy_(0, order, outputs)
        expected = scattered.view(tokens, top_k, -1).sum(dim=1).to(torch.bfloat16)
        assert torch.equal(built.combine_rows(y, weights.view(-1), order, top_k), expected)
    with pytest.raises(RuntimeError, match="not a permutation"):
        built.combine_rows(y, weights.view(-1), torch.zeros_like(order), top_k)


@pytest.mark.parametrize("name", ["q4_k", "original"])
def test_amx_tiles_and_dot_products_give_a_prompt_the_same_products(name):
    # Beside AMX tiles a prompt's bf16 products run on them (arch/x86/prompt_amx.h) and the dot products are
    # no longer the default; both stay the dequantized bf16 product to summation order: experts
    # whose rows fill one to four 16-row blocks, a matrix whose height is no multiple of 16, a
    # bf16 matrix read in place and one interleaved gate/up.
    built = native.load()
    if built is None or not built.amx():
        pytest.skip("no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
    hidden, inter, counts = 512, 256, [1, 16, 17, 33, 49, 64, 0]
    fmt = None if name == "original" else checkpoint_format(name)

    def matrix(rows: int, columns: int, seed: int) -> tuple:
        if fmt is None:
            w = (torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)
            return native.weight(built, w), w
        packed, reference = quantized(name, rows, columns, seed=seed)
        return native.weight(built, packed, fmt, columns), reference

    gate_up = [matrix(2 * inter, hidden, 10 + e) for e in range(len(counts))]
    down = [matrix(hidden, inter, 30 + e) for e in range(len(counts))]
    rows = (torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    start = [sum(counts[:e]) for e in range(len(counts))]
    odd = matrix(100, hidden, 50)
    results = {}
    for amx in (True, False):
        with forced_paths(built, amx=amx):
            assert built.amx() == amx and ("-amx" in built.code_path()) == amx
            results[amx] = (built.linear_rows(odd[0], rows[:37]),
                            built.moe_prompt(rows, start, counts, [w for w, _ in gate_up], [w for w, _ in down]),
                            built.moe_prompt(rows, start, counts, [w for w, _ in gate_up], [w for w, _ in down],
                                             recipe=built.GateRecipe(interleaved=True)))
    for amx, (linear, experts, interleaved) in results.items():
        close(linear, F.linear(rows[:37], odd[1]), f"linear_rows, amx {amx}")
        for e, (first, count) in enumerate(zip(start, counts[:-1], strict=False)):  # the last has no rows
            x = rows[first:first + count]
            for out, (gate, up) in ((experts, gate_up[e][1].chunk(2)), (interleaved, (gate_up[e][1][0::2], gate_up[e][1][1::2]))):
                act = (F.silu(F.linear(x, gate)) * F.linear(x, up)).to(torch.bfloat16)
                close(out[first:first + count], F.linear(act, down[e][1]), f"expert {e}, amx {amx}")
    assert not torch.equal(results[True][1], results[False][1])  # two paths really ran


def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x rounded as --int8-inputs rounds it: per 256 values, levels to nearest even of x * 127 / max|x|."""
    blocks = x.float().reshape(x.shape[0], -1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    return (torch.round(blocks * inverse).clamp(-127, 127) * (amax / 127)).reshape(x.shape)


def q4_k_parts(packed: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K matrix's two terms, through the reference dequantizer: d * sc * level, and dmin * m
    (the weights with every level zeroed are minus the mins)."""
    fmt = checkpoint_format("q4_k")
    weights = dequantize(packed, fmt, columns)
    no_levels = packed.clone().reshape(-1, fmt.block_bytes)
    no_levels[:, 16:] = 0
    mins = -dequantize(no_levels, fmt, columns)
    return weights + mins, mins


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_8_bit_inputs_of_a_one_row_product_are_the_input_rounded(variant, name):
    # --int8-inputs (opt-in, lossy) at decode: a K-quant matrix's integer dot takes the input rounded
    # to 8 bits per 256 values (llama.cpp's Q8_K), and nothing else changes: its product is the
    # reference's weights times that rounded input, to bf16 rounding. The other types' dots take one
    # 16-bit product per weight either way, so their inputs are not rounded: the same bits.
    packed, reference = quantized(name, rows=300, columns=1024, seed=2)
    x = (torch.randn(1, 1024, generator=torch.Generator().manual_seed(8)) * 0.5).to(torch.bfloat16)
    x[0, :7] = torch.tensor([3.0, -3.0, 1e-3, -1e-3, 0.0, 2.5, -2.99])
    x[0, 512:768] = 0.0  # a chunk of zeros: its scale has nothing to divide by
    weight = native.weight(variant, packed, checkpoint_format(name), 1024)
    with forced_paths(variant, int8_inputs=True):
        ours = variant.gemv(weight, x)
    exact_inputs = variant.gemv(weight, x)
    if name not in K_QUANTS:
        assert torch.equal(ours, exact_inputs)
        return
    rounded = rounded_to_8_bits(x).double() @ reference.double().t()
    assert (ours.double() - rounded).abs().max() <= 0.005 * rounded.abs().max()  # bf16 rounding of the result
    assert not torch.equal(ours, exact_inputs)  # the inputs really were rounded


@pytest.mark.parametrize("rows", [1, 8, 13])
def test_8_bit_prompt_inputs_reach_a_q4_k_linear_and_no_other(variant, rows):
    # --int8-inputs also rounds the inputs of a prompt's dense Q4_K linears (attention's projections):
    # the same arithmetic as the experts', with the bias added before the one rounding; a Q6_K linear
    # is untouched, bit for bit
    columns, out = 512, 40
    x = (torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows)) * 2).to(torch.bfloat16)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    packed, _ = quantized("q4_k", out, columns, seed=60 + rows)
    weight = native.weight(variant, packed, checkpoint_format("q4_k"), columns)
    ours = variant.linear_rows(weight, x, bias, True)
    scaled, mins = q4_k_parts(packed, columns)
    reference = rounded_to_8_bits(x).double() @ scaled.double().T - x.double() @ mins.double().T + bias.double()
    close(ours, reference.to(torch.bfloat16), f"{rows} rows")
    assert not torch.equal(ours, variant.linear_rows(weight, x, bias))  # the inputs really were rounded
    q6 = native.weight(variant, quantized("q6_k", out, columns, seed=61)[0], checkpoint_format("q6_k"), columns)
    assert torch.equal(variant.linear_rows(q6, x, bias, True), variant.linear_rows(q6, x, bias))


@pytest.mark.parametrize("down_format", ["q4_k", "q6_k"])
def test_8_bit_prompt_inputs_round_only_the_scaled_products(variant, down_format):
    # --int8-inputs (opt-in, lossy): Q4_K matrices multiply each row's inputs rounded to 8 bits per
    # 256 values in integers; the mins multiply the exact inputs. Every expert's rows equal that
    # arithmetic done in float64 on the reference's terms (to bf16 rounding); matrices of other types
    # (the Q6_K down projections of a Q4_K_M file) are untouched, bit for bit. Experts with 0, 1, 8
    # and 9 rows: the kernel works on groups of 8 rows, the last one padded.
    hidden, inter, counts = 512, 256, [5, 0, 9, 1, 8, 3]
    fmt, down_fmt = checkpoint_format("q4_k"), checkpoint_format(down_format)
    gate_up = [quantized("q4_k", 2 * inter, hidden, seed=70 + e)[0] for e in range(len(counts))]
    down = [quantized(down_format, hidden, inter, seed=80 + e)[0] for e in range(len(counts))]
    rows = (torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    start = [sum(counts[:e]) for e in range(len(counts))]
    args = (rows, start, counts, [native.weight(variant, w, fmt, hidden) for w in gate_up],
            [native.weight(variant, w, down_fmt, inter) for w in down])
    ours, bf16_inputs = variant.moe_prompt(*args, int8_inputs=True), variant.moe_prompt(*args)

    def product(x: torch.Tensor, packed: torch.Tensor, columns: int, name: str) -> torch.Tensor:
        if name != "q4_k":
            return (x.double() @ dequantize(packed, down_fmt, columns).double().T).to(torch.bfloat16)
        scaled, mins = q4_k_parts(packed, columns)
        return (rounded_to_8_bits(x).double() @ scaled.double().T - x.double() @ mins.double().T).to(torch.bfloat16)

    for e, (first, count) in enumerate(zip(start, counts, strict=True)):
        if count == 0:
            continue
        gate, up = product(rows[first:first + count], gate_up[e], hidden, "q4_k").chunk(2, dim=-1)
        reference = product(F.silu(gate) * up, down[e], inter, down_format)
        close(ours[first:first + count], reference, f"expert {e} ({count} rows)")
    assert not torch.equal(ours, bf16_inputs)  # the inputs really were rounded
    if down_format == "q6_k":  # experts with no Q4_K matrix at all: the switch changes no bit
        gate_up_q6 = [native.weight(variant, quantized("q6_k", 2 * inter, hidden, seed=90 + e)[0], down_fmt, hidden)
                      for e in range(len(counts))]
        plain = (rows, start, counts, gate_up_q6, args[4])
        assert torch.equal(variant.moe_prompt(*plain, int8_inputs=True), variant.moe_prompt(*plain))
