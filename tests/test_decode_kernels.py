"""The native one-token kernels behind --fast-decode (engine/native/moe_decode.cpp): they build on
a machine with a C++ compiler and compute what transformers' modules compute, to bf16 rounding."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import decode_kernels


@pytest.fixture(scope="module")
def kernels():
    built = decode_kernels.wait(timeout=600)
    if built is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"a C++ compiler is here but the kernels did not build: {decode_kernels.status()}")
        pytest.skip(decode_kernels.status())
    return built


def close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    # bf16 results summed in another order: within a couple of bf16 steps of the reference
    scale = reference.float().abs().max().item()
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= 0.02 * scale, f"{what}: max error {error} vs scale {scale}"


@pytest.mark.parametrize("shape", [(1024, 1024), (300, 96), (17, 200)], ids=str)
def test_gemv_matches_linear(kernels, shape):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 1, shape[1], generator=generator).to(torch.bfloat16)
    y = kernels.gemv(weight, x)
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


def test_moe_decode_matches_the_expert_path(kernels):
    # One token through 8 of 64 experts of a real transformers experts module, as the cache runs it.
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from engine import fast_decode
    from engine.expert_mlp import expert_mlp, weighted_sum

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=96, num_experts=64, num_experts_per_tok=8)
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.05)
        module.down_proj.normal_(0, 0.05)
    assert fast_decode.experts_fusable(module)
    picks = [3, 60, 17, 0, 42, 5, 33, 8]
    slots = [{"gate_up_proj": module.gate_up_proj[e], "down_proj": module.down_proj[e]} for e in picks]
    hidden = torch.randn(1, 256).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(8), dim=0)
    reference = weighted_sum([expert_mlp(module, hidden, w) for w in slots], weights, torch.float32, torch.bfloat16)
    fused = kernels.moe_decode(hidden, [w["gate_up_proj"] for w in slots], [w["down_proj"] for w in slots], weights)
    assert fused.shape == reference.shape and fused.dtype == torch.bfloat16
    close(fused, reference, "moe_decode")


def test_bad_shapes_are_refused_with_a_message(kernels):
    weight = torch.randn(8, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="one bf16 row"):
        kernels.gemv(weight, torch.randn(1, 17).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 CPU tensor"):
        kernels.gemv(weight.float(), torch.randn(1, 16).to(torch.bfloat16))


def test_experts_with_biases_or_other_gates_are_not_fused():
    # GPT-OSS-style experts (biases, interleaved clamped gate) keep the torch path.
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine import fast_decode

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    assert not fast_decode.experts_fusable(GptOssExperts(config))
