"""Issue 62: the fit estimate's peak RSS for a run is within 5 % of the peak a real run reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.estimate_check import GOAL, run_child, tiny_checkpoint
from engine.hub.estimate import estimate_folder
from engine.hub.footprint import budget_slots, run_footprint

# The runtime constant is the CPU build's (the README installs it): a CUDA build of torch keeps its GPU
# libraries resident in every process, `--device cpu` too.
pytestmark = [pytest.mark.process,
              pytest.mark.skipif(torch.version.cuda is not None, reason="the runtime constant is torch's CPU build's")]
MiB = 1024**2


@pytest.mark.parametrize("budget", ["25%", "all"])
def test_estimated_peak_is_within_five_percent_of_the_measured(tmp_path, budget, capsys):
    path = tiny_checkpoint(tmp_path, 8, 64)  # 8 layers x 64 experts: 4 MiB of experts, pools below 2 MiB pages
    row = run_child("tiny", path, budget)
    assert "error" not in row, row
    estimate, measured = row["estimate"]["peak"], row["measured"]["peak"]
    with capsys.disabled():
        print(f"\n[footprint {budget}] estimate {estimate / MiB:.1f} MiB, measured peak {measured / MiB:.1f} MiB "
              f"({estimate / measured:.3f})")
    assert abs(estimate / measured - 1) <= GOAL


def test_parallel_sequences_each_hold_a_kv_cache_and_the_budget_is_whole_slots(tmp_path):
    est = estimate_folder(Path(tiny_checkpoint(tmp_path, 4, 8)))
    one = run_footprint(est, "all", context_tokens=4096)
    four = run_footprint(est, "all", context_tokens=4096, parallel=4)
    assert four.kv_cache == 4 * one.kv_cache == 4 * 4096 * est.kv_bytes_per_token
    assert four.peak - one.peak >= 3 * one.kv_cache
    slots = budget_slots(est, "25%")
    assert sum(slots) == est.num_experts * est.num_moe_layers // 4 and len(slots) == est.num_moe_layers
    assert budget_slots(est, 1) == [est.top_k] * est.num_moe_layers  # never below the minimum
    assert run_footprint(est, "25%", context_tokens=32).scratch > 0 == run_footprint(est, "all", context_tokens=32).scratch
