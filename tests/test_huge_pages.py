"""CPU weights in memory advised for 2 MiB pages (engine.system.huge_pages): decode streams every active
weight once per token, and with huge pages the same reads ran 2-5 % faster on the test VM."""

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


def test_a_rehomed_tensor_keeps_its_values_and_small_ones_stay_put():
    big = torch.randn(1024, 1024).to(torch.bfloat16)
    moved = huge_pages.rehome(big)
    assert torch.equal(moved, big) and moved.data_ptr() != big.data_ptr()
    assert "hg" in vm_flags_of(moved.data_ptr())
    small = torch.randn(16, 16)
    assert huge_pages.rehome(small) is small  # a few 4 KiB pages: nothing to gain


def test_the_mapping_is_freed_with_the_tensor():
    weights = huge_pages.empty_bytes(16 << 20)
    address = weights.data_ptr()
    assert vm_flags_of(address)
    del weights
    assert "hg" not in vm_flags_of(address)  # unmapped (or reused by something not advised)
