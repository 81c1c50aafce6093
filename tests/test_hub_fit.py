"""Sizes from published config.json files, checked against published parameter counts, and the
fit verdict for made-up machines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.errors import CheckpointError
from engine.hub.estimate import estimate_from_config
from engine.hub.fit import assess, budget_arg
from engine.hub.machine import MachineInfo
from engine.model.layout import SLOT_ALIGN
from tests.helpers.checkpoints import FAMILIES

FIXTURES = Path(__file__).parent / "helpers" / "hub"
GiB = 1024**3
MiB = 1024**2

# Published totals and active counts (billions). `embedding_in_active`: whether the publisher's active
# count includes the input embedding (Mistral, Qwen and AllenAI count it; DeepSeek and OpenAI do not).
PUBLISHED = {
    "mixtral-8x7b": dict(total=46.7, active=12.9, embedding_in_active=True, layers=32, experts=8, top_k=2),
    "qwen3-30b-a3b": dict(total=30.5, active=3.3, embedding_in_active=True, layers=48, experts=128, top_k=8),
    "deepseek-v2-lite": dict(total=15.7, active=2.4, embedding_in_active=False, layers=26, experts=64, top_k=6),
    "olmoe-1b-7b": dict(total=6.9, active=1.3, embedding_in_active=True, layers=16, experts=64, top_k=8),
    "gpt-oss-20b": dict(total=20.9, active=3.6, embedding_in_active=False, layers=24, experts=32, top_k=4),
}


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def estimates() -> dict:
    return {name: estimate_from_config(load(name)) for name in PUBLISHED}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_sizes_match_published_parameter_counts(estimates, name):
    est, pub = estimates[name], PUBLISHED[name]
    bpp = {"bfloat16": 2, "float32": 4}[est.dtype]
    assert est.bytes_per_param == bpp
    assert (est.num_moe_layers, est.num_experts, est.top_k) == (pub["layers"], pub["experts"], pub["top_k"])
    assert est.expert_params + est.dense_params == est.total_params
    assert est.total_params == pytest.approx(pub["total"] * 1e9, rel=0.03)
    active = est.active_params - (0 if pub["embedding_in_active"] else est.embedding_params)
    assert active == pytest.approx(pub["active"] * 1e9, rel=0.03)
    if est.quantization:
        return  # its experts are counted in the checkpoint's blocks: test_an_mxfp4_checkpoint_is_sized_in_its_own_blocks
    # the bytes: expert and dense bytes add up to the published count times bytes per parameter
    assert est.expert_bytes + est.dense_bytes == pytest.approx(pub["total"] * 1e9 * bpp, rel=0.03)
    per_expert = est.expert_params // (est.num_experts * est.num_moe_layers)
    active_bytes = est.dense_bytes + est.top_k * est.num_moe_layers * per_expert * bpp
    assert active_bytes - (0 if pub["embedding_in_active"] else est.embedding_params * bpp) == pytest.approx(
        pub["active"] * 1e9 * bpp, rel=0.03)
    # the engine's slot layout: aligned, a little above the raw bytes of one expert
    assert est.bytes_per_expert % SLOT_ALIGN == 0
    assert per_expert * bpp <= est.bytes_per_expert < per_expert * bpp + 8 * SLOT_ALIGN
    assert est.all_expert_bytes == est.bytes_per_expert * est.num_experts * est.num_moe_layers
    assert est.min_budget_bytes == est.bytes_per_expert * est.top_k * est.num_moe_layers


def test_an_mxfp4_checkpoint_is_sized_in_its_own_blocks(estimates):
    est = estimates["gpt-oss-20b"]
    assert est.quantization == "mxfp4" and est.runnable
    # MXFP4 experts (4.25 bits) + bf16 rest: OpenAI publishes a 12.8 GiB checkpoint
    assert est.download_bytes == pytest.approx(12.8 * GiB, rel=0.03)
    # the experts' slots hold MXFP4 blocks (+ bf16 biases), not bf16: about 4.25 / 16 of it
    per_expert = est.expert_params // (est.num_experts * est.num_moe_layers)
    assert est.bytes_per_expert == pytest.approx(per_expert * 4.25 / 8, rel=0.01)
    assert est.all_expert_bytes == est.bytes_per_expert * est.num_experts * est.num_moe_layers
    assert assess(est, machine(ram=256 * GiB)).kind != "unsupported"


def test_another_quantization_is_estimated_but_not_runnable(estimates):
    config = {**load("qwen3-30b-a3b"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    est = estimate_from_config(config)
    assert not est.runnable and est.problem.startswith("awq quantized weights are not supported by MoEScope")
    verdict = assess(est, machine(ram=256 * GiB))
    assert verdict.kind == "unsupported" and verdict.headline.startswith("cannot run yet: awq quantized")


def test_plain_checkpoints_are_runnable(estimates):
    # DeepSeek-V2-Lite's config.json still names custom code (auto_map), but transformers ships the
    # architecture, so the engine uses transformers' own code and never the repo's.
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite"):
        assert estimates[name].runnable, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimate_agrees_with_the_engines_own_layout(tiny_checkpoints, family):
    from engine.hub.estimate import estimate_folder
    from engine.model.inspect import inspect_checkpoint

    path = tiny_checkpoints[family]
    est, info = estimate_folder(path), inspect_checkpoint(str(path))
    assert est.bytes_per_expert == info.expert_bytes
    assert est.all_expert_bytes == info.all_expert_bytes
    assert est.min_budget_bytes == info.min_budget_bytes
    assert est.dense_bytes == info.dense_bytes
    assert (est.num_moe_layers, est.num_experts, est.top_k) == (info.num_moe_layers, info.num_experts, info.top_k)
    assert est.download_bytes == sum(p.stat().st_size for p in path.glob("*.safetensors"))


def test_dense_and_unknown_models():
    llama = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    est = estimate_from_config(llama)
    assert est.problem == "a dense model, not a mixture-of-experts model; MoEScope offloads experts"
    with pytest.raises(CheckpointError, match="does not know model type 'no-such-moe'; update transformers"):
        estimate_from_config({"model_type": "no-such-moe"})


# ----------------------------------------------------------------------------- verdicts


def machine(*, ram: int, disk: int = 10**15, gpu: int = 0, cuda: bool = True) -> MachineInfo:
    return MachineInfo(ram_total=ram, ram_available=ram, disk_free=disk, gpu_name="Test GPU" if gpu else None,
                       vram_total=gpu, vram_free=gpu, cuda_usable=bool(gpu) and cuda)


def test_fits_in_gpu(estimates):
    est = estimates["qwen3-30b-a3b"]  # 2.9 GiB dense + 54 GiB experts
    verdict = assess(est, machine(ram=128 * GiB, gpu=80 * GiB))
    assert verdict.kind == "fits-gpu" and verdict.device == "cuda" and verdict.budget_arg == "all"
    assert verdict.headline.startswith("fits in GPU memory: 2.87 GiB dense + 54.00 GiB experts of 80.00 GiB free on Test GPU")


def test_gpu_with_experts_offloaded_to_ram_or_disk(estimates):
    est = estimates["mixtral-8x7b"]  # 84 GiB of experts, 21 GiB minimum
    verdict = assess(est, machine(ram=256 * GiB, gpu=40 * GiB))
    assert (verdict.kind, verdict.device, verdict.store) == ("offload", "cuda", "ram")
    assert est.min_budget_bytes <= verdict.budget_bytes <= 40 * GiB
    assert verdict.budget_bytes % est.bytes_per_expert == 0
    assert verdict.headline.startswith("runs on Test GPU with experts offloaded to RAM, budget ")
    assert assess(est, machine(ram=64 * GiB, gpu=40 * GiB)).store == "disk"  # 84 GiB of experts do not fit in RAM


def test_cpu_only(estimates):
    est = estimates["qwen3-30b-a3b"]
    assert assess(est, machine(ram=96 * GiB)).kind == "fits-ram"
    verdict = assess(est, machine(ram=16 * GiB))
    assert (verdict.kind, verdict.device, verdict.store) == ("offload", "cpu", "disk")
    assert est.min_budget_bytes <= verdict.budget_bytes < 16 * GiB
    assert verdict.headline.startswith("runs with experts offloaded to disk, budget ")
    assert f"minimum {3.375:.2f} GiB" in verdict.headline and "16.00 GiB RAM available" in verdict.headline


def test_too_big(estimates):
    verdict = assess(estimates["mixtral-8x7b"], machine(ram=8 * GiB))
    assert verdict.kind == "too-big" and not verdict.runs
    assert verdict.headline.startswith("too big for this machine: needs at least ")
    assert "(dense 2.99 GiB + minimum budget 21.00 GiB + working memory" in verdict.headline
    assert verdict.headline.endswith("8.00 GiB RAM available")


def test_the_engines_own_memory_comes_out_of_ram_before_the_experts(estimates):
    from engine.hub.fit import ACTIVATION_MARGIN
    from engine.system.memory import ENGINE_OVERHEAD_ESTIMATE

    est = estimates["olmoe-1b-7b"]
    working = est.dense_bytes + est.all_expert_bytes + est.kv_bytes + ACTIVATION_MARGIN
    # room for dense weights, every expert and the working memory, not for the engine itself: not "fits"
    short = assess(est, machine(ram=working + ENGINE_OVERHEAD_ESTIMATE // 2))
    assert short.kind == "offload" and short.budget_bytes < est.all_expert_bytes
    assert any("engine overhead" in d and "estimated until a model loads" in d for d in short.details)
    assert assess(est, machine(ram=working + ENGINE_OVERHEAD_ESTIMATE)).kind == "fits-ram"
    # a measured overhead replaces the estimate where it is larger than this model's footprint
    measured = MachineInfo(ram_total=10**12, ram_available=working + 64 * MiB, disk_free=10**15,
                           engine_overhead=900 * MiB, overhead_measured=True)
    verdict = assess(est, measured)
    assert verdict.kind == "offload"
    assert any("engine overhead 900.00 MiB (measured at this engine's last load)" in d for d in verdict.details)


def test_the_verdict_never_counts_less_engine_memory_than_the_model_needs(estimates):
    from engine.hub.fit import ACTIVATION_MARGIN
    from engine.hub.footprint import engine_own_bytes

    est = estimates["olmoe-1b-7b"]
    own = engine_own_bytes(est, "all")
    working = est.dense_bytes + est.all_expert_bytes + est.kv_bytes + ACTIVATION_MARGIN
    # a small figure measured on another model does not shrink this one's bookkeeping
    small = MachineInfo(ram_total=10**12, ram_available=working + own - MiB, disk_free=10**15,
                        engine_overhead=128 * MiB, overhead_measured=True)
    assert assess(est, small).kind == "offload"
    assert assess(est, replace(small, ram_available=working + own)).kind == "fits-ram"


def test_the_machine_probe_takes_the_overhead_this_process_measured(tmp_path, monkeypatch):
    from engine.hub.machine import probe_machine
    from engine.system import memory

    monkeypatch.setattr(memory.PROCESS, "measured_overhead", None)
    before = probe_machine(tmp_path)
    assert (before.engine_overhead, before.overhead_measured) == (memory.ENGINE_OVERHEAD_ESTIMATE, False)
    memory.note_overhead(memory.EngineOverhead(baseline_bytes=300 * MiB, loaded_bytes=900 * MiB,
                                               dense_bytes=200 * MiB, expert_bytes=300 * MiB))
    after = probe_machine(tmp_path)
    assert (after.engine_overhead, after.overhead_measured) == (400 * MiB, True)


def test_gpu_too_small_falls_back_to_cpu_and_says_why(estimates):
    verdict = assess(estimates["mixtral-8x7b"], machine(ram=64 * GiB, gpu=8 * GiB))
    assert verdict.device == "cpu"
    assert any("exceed the free GPU memory" in d for d in verdict.details)


def test_gpu_without_cuda_in_pytorch(estimates):
    verdict = assess(estimates["olmoe-1b-7b"], machine(ram=64 * GiB, gpu=24 * GiB, cuda=False))
    assert verdict.device == "cpu"
    assert any("no CUDA support" in d for d in verdict.details)


def test_needs_more_disk(estimates):
    est = estimates["qwen3-30b-a3b"]
    verdict = assess(est, machine(ram=96 * GiB, disk=20 * GiB), missing_bytes=est.download_bytes)
    short = est.download_bytes - 20 * GiB
    assert verdict.disk_short_bytes == short
    assert verdict.headline.startswith(f"needs {short / GiB:.2f} GiB more disk (download ")
    assert "20.00 GiB free); then: fits in RAM" in verdict.headline


def test_budget_arg_never_goes_below_the_minimum(estimates):
    est = estimates["qwen3-30b-a3b"]
    assert budget_arg(est.all_expert_bytes, est) == "all"
    assert budget_arg(int(10.77 * GiB), est) == "10.7GiB"
    assert budget_arg(est.min_budget_bytes, est) == "3.3GiB" or budget_arg(est.min_budget_bytes, est).endswith("MiB")
    from engine.accounting.sizes import parse_size

    assert parse_size(budget_arg(est.min_budget_bytes, est)) >= est.min_budget_bytes


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q2_k"])
def test_sizes_in_a_format_are_the_engines_quantized_layout(tmp_path_factory, family, fmt):
    # the config-only estimate in a format counts the bytes the engine's quantized store will hold
    from engine.formats.blocks import parse_format
    from engine.hub.estimate import estimate_folder
    from engine.model.inspect import inspect_checkpoint
    from tests.helpers.checkpoints import WIDE, save_tiny_checkpoint

    path = save_tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}-{fmt}") / family, **WIDE[family])
    sized = estimate_folder(path).in_format(parse_format(fmt))
    info = inspect_checkpoint(path, expert_format=parse_format(fmt))
    assert (sized.bytes_per_expert, sized.all_expert_bytes, sized.min_budget_bytes) == (
        info.expert_bytes, info.all_expert_bytes, info.min_budget_bytes)
    assert sized.expert_format == fmt


def test_the_verdict_per_format_says_which_format_makes_the_model_fit(estimates):
    from engine.hub.fit import format_summary, format_verdicts

    # Mixtral 8x7B on 32 GiB of RAM: offloaded in bf16, whole at 4 bits and below
    verdicts = format_verdicts(estimates["mixtral-8x7b"], machine(ram=32 * GiB))
    kinds = {v.format: v.verdict.kind for v in verdicts}
    assert kinds == {"original": "offload", "q8_0": "offload", "q6_k": "offload", "q4_k": "fits-ram",
                     "q3_k": "fits-ram", "q2_k": "fits-ram"}
    bytes_ = [v.estimate.all_expert_bytes for v in verdicts]
    assert bytes_ == sorted(bytes_, reverse=True) and bytes_[3] == pytest.approx(bytes_[0] * 4.5 / 16, rel=0.01)
    summary = format_summary(verdicts)
    assert summary.startswith("fits in RAM at 4-bit (") and summary.endswith("; offloaded at 26% in bf16")
    # whole in its own weights: nothing to compare
    assert format_summary(format_verdicts(estimates["olmoe-1b-7b"], machine(ram=64 * GiB))) == ""


def test_a_format_the_experts_cannot_take_is_left_out(tmp_path):
    from engine.hub.estimate import estimate_folder
    from engine.hub.fit import format_verdicts
    from tests.helpers.checkpoints import save_tiny_checkpoint

    # OLMoE's tiny experts are 24 wide: no block format (32 or 256 elements) stores their down projection
    est = estimate_folder(save_tiny_checkpoint("olmoe", tmp_path / "olmoe"))
    assert [v.format for v in format_verdicts(est, machine(ram=64 * GiB))] == ["original"]


def test_the_verdict_says_how_many_replies_fit_at_once_each_with_its_kv_cache(estimates):
    from engine.hub.fit import ACTIVATION_MARGIN, with_model_footprint

    est = estimates["olmoe-1b-7b"]
    base = machine(ram=10**12)
    own = with_model_footprint(est, base).engine_overhead
    whole = est.dense_bytes + est.all_expert_bytes + est.kv_bytes + ACTIVATION_MARGIN + own
    assert assess(est, machine(ram=whole)).parallel == 1  # room for one reply's KV cache only
    two = assess(est, machine(ram=whole + est.kv_bytes))
    assert two.kind == "fits-ram" and two.parallel == 2
    assert any(d.startswith("replies at once: 2 fit beside this budget") for d in two.details)
    assert assess(est, machine(ram=whole + 100 * est.kv_bytes)).parallel == 4  # at most four
