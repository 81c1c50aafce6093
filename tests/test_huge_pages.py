"""CPU weights in memory advised for 2 MiB pages (engine.system.huge_pages): decode streams every active
weight once per token, and with huge pages the same reads ran faster on the test VMs."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from engine.system import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="transparent huge pages are a Linux feature")


def vm_flags_of(address: int) -> list[str]:
    """The kernel's flags for the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_big_weights_get_aligned_huge_page_advised_memory():
    weights = huge_pages.empty((4096, 1024), torch.bfloat16)  # 8 MiB
    assert weights.data_ptr() % huge_pages.HUGE_PAGE == 0  # the kernel needs 2 MiB alignment
    assert "hg" in vm_flags_of(weights.data_ptr())  # MADV_HUGEPAGE, what THP's `madvise` mode asks for
    weights.copy_(torch.arange(4096 * 1024).reshape(4096, 1024).to(torch.bfloat16))
    assert weights[4095, 1023].item() == torch.tensor(4096 * 1024 - 1, dtype=torch.bfloat16).item()


def test_gathered_weights_share_huge_pages_and_compute_the_same():
    torch.manual_seed(0)
    d = 512  # float32: the matrices below take ~3.5 MiB together, room for a huge page
    embed = torch.nn.Embedding(4 * d, d)
    model = torch.nn.ModuleDict({"embed": embed, "q": torch.nn.Linear(d, d), "k": torch.nn.Linear(d, d // 4),
                                 "norm": torch.nn.LayerNorm(d), "head": torch.nn.Linear(d, 2 * d, bias=False)})
    model.register_buffer("table", torch.randn(64, 64))
    model.requires_grad_(False)
    x = torch.randn(3, d)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    embedding_at = embed.weight.data_ptr()

    def forward() -> torch.Tensor:
        return model["head"](model["norm"](model["q"](x) + model["k"](x).repeat(1, 4)))

    expected = forward()
    moved = huge_pages.gather(model, skip=[embed.weight])
    matrices = [model["q"].weight, model["k"].weight, model["head"].weight, model.table]
    assert moved == sum(t.nbytes for t in matrices)  # biases' and the norm's few bytes stay where they are
    assert embed.weight.data_ptr() == embedding_at  # skipped: a token reads one row of it
    assert all("hg" in vm_flags_of(t.data_ptr()) and t.data_ptr() % 64 == 0 for t in matrices)
    assert len({t.untyped_storage().data_ptr() for t in matrices}) == 1  # one mapping: side by side
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(forward(), expected)
    assert isinstance(model["q"].weight, torch.nn.Parameter) and not model["q"].weight.requires_grad


def test_gathering_keeps_tied_weights_tied():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(4096, 256), "head": torch.nn.Linear(256, 4096, bias=False)})
    model["head"].weight = model["embed"].weight
    assert huge_pages.gather(model) == 4096 * 256 * 4  # moved once
    assert model["head"].weight is model["embed"].weight
    assert "hg" in vm_flags_of(model["head"].weight.data_ptr())


def test_the_mapping_is_freed_with_the_tensor():
    weights = huge_pages.empty_bytes(16 << 20)
    address = weights.data_ptr()
    assert vm_flags_of(address)
    del weights
    assert "hg" not in vm_flags_of(address)  # unmapped (or reused by something not advised)


def test_a_loaded_models_dense_weights_are_gathered_into_huge_pages(tmp_path):
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel
    from tests.helpers.checkpoints import write_large_qwen3_moe

    path = write_large_qwen3_moe(tmp_path / "qwen3-moe", layers=2, experts=8, expert_intermediate=128)
    for dense_format in (None, "q8_0"):  # the checkpoint's bf16, and blocks made at load
        runtime = MoERuntime(LoadModel(path=str(path), budget="all", dense_format=dense_format, fast_decode=False))
        try:
            attention = runtime.model.model.layers[1].self_attn
            weights = [getattr(getattr(attention, name), "packed", None) for name in ("q_proj", "k_proj", "o_proj")]
            weights = [w if w is not None else getattr(attention, name).weight
                       for w, name in zip(weights, ("q_proj", "k_proj", "o_proj"), strict=True)]
            weights.append(runtime.model.model.layers[1].mlp.gate.weight)  # the router, 16 KiB
            assert all("hg" in vm_flags_of(w.data_ptr()) for w in weights), dense_format
            assert len({w.untyped_storage().data_ptr() for w in weights}) == 1  # one arena
            embedding = runtime.model.get_input_embeddings().weight
            assert embedding.untyped_storage().data_ptr() != weights[0].untyped_storage().data_ptr()
        finally:
            runtime.close()


def test_gathering_hands_the_originals_memory_back():
    import psutil

    from engine.system import memory

    # 64 KiB tensors come from the C heap, which keeps freed pages resident unless told otherwise
    model = torch.nn.ModuleList(torch.nn.Linear(128, 128, bias=False) for _ in range(512))  # 32 MiB
    memory.release_free_heap()
    before = psutil.Process().memory_info().rss
    assert huge_pages.gather(model) == 512 * 128 * 128 * 4
    grown = psutil.Process().memory_info().rss - before
    assert grown < 12 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB moving 32 MiB"
