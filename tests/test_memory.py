"""The budget is honest: with the disk store, peak RSS stays near dense weights + budget."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.model.inspect import inspect_checkpoint
from tests.helpers.checkpoints import write_large_qwen3_moe
from tests.helpers.quantized_checkpoints import write_large_mxfp4_gpt_oss

# The slack is the CPU build's (the README installs it): a CUDA build of torch keeps its GPU libraries
# resident in every process, on `--device cpu` too (the engine measured 828 MiB of its own there, H100 machine).
pytestmark = [pytest.mark.process,
              pytest.mark.skipif(torch.version.cuda is not None, reason="memory slack is set for torch's CPU build")]

BUDGET = 128 * 2**20
SLACK = 600 * 2**20  # Python, torch and transformers themselves
# oneDNN's kernels for a prompt's new matrix shapes, beyond the load's: on the fast path only gpt-oss's
# two eager-attention matmuls (about 1 MiB); every shape's while the native kernels are still loading
NEW_SHAPES_ALLOWANCE = 16 * 2**20


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    # 8 MoE layers x 128 experts x 1.5 MiB (bf16) = 1.5 GiB of experts; top-8 makes the minimum 96 MiB.
    return write_large_qwen3_moe(tmp_path_factory.mktemp("large") / "qwen3-moe-1g", layers=8, experts=128,
                                 expert_intermediate=256)


def moescope(*args: str) -> dict:
    # `--device cpu` for generate: the RAM budget is what these hold to (on a GPU machine RSS also
    # holds the CUDA runtime, and the cache lives in GPU memory).
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_peak_rss_stays_within_dense_plus_budget(large_checkpoint, capsys):
    info = inspect_checkpoint(large_checkpoint)  # the sizes `moescope info` shows, from the headers
    assert info.all_expert_bytes >= 2**30
    result = moescope("generate", "--device", "cpu", "--model", str(large_checkpoint),
                      "--store", "disk", "--budget", "128MiB",
                      "--prompt-ids", "1,5,9,200,33,7,80,12", "--raw", "--max-new-tokens", "4", "--json")
    stats = result["stats"]
    limit = info.dense_bytes + BUDGET + SLACK
    with capsys.disabled():
        print(f"\n[honest memory] experts {info.all_expert_bytes / 2**30:.2f} GiB, dense "
              f"{info.dense_bytes / 2**20:.0f} MiB, budget 128 MiB -> peak RSS {stats['peak_rss_bytes'] / 2**20:.0f} MiB "
              f"(limit {limit / 2**20:.0f} MiB)")
    assert stats["budget_bytes"] <= BUDGET
    assert stats["bytes_loaded"] > 0
    assert stats["peak_rss_bytes"] < limit
    assert stats["decode_tokens"] >= 1


def test_an_mxfp4_checkpoint_is_budgeted_in_its_own_bytes(tmp_path, capsys):
    # 4 MoE layers x 64 gpt-oss-shaped experts kept MXFP4: 0.4 GiB (3.8x that in bf16), 25 % budget.
    # Issue 21's goal: the peak stays within dense + budget + the engine's own memory as the load
    # reported it (its first forward's peak included). oneDNN keeps a generated kernel for each new
    # matrix shape the reply's prompt meets (docs/performance.md), and the reply's heap lands where it
    # lands, hence the allowance; measured 0.1-0.5 MiB either side of the goal.
    path = write_large_mxfp4_gpt_oss(tmp_path / "gpt-oss-mxfp4", layers=4)
    info = inspect_checkpoint(path)
    assert info.expert_format == "mxfp4" and info.all_expert_bytes < 0.45 * 2**30
    result = moescope("generate", "--device", "cpu", "--model", str(path),
                      "--store", "disk", "--budget", "25%",
                      "--prompt-ids", "1,5,9,200,33,7,80,12", "--raw", "--max-new-tokens", "4", "--json")
    stats = result["stats"]
    limit = info.dense_bytes + stats["budget_bytes"] + SLACK
    reported = info.dense_bytes + stats["budget_bytes"] + result["engine_overhead_bytes"]
    with capsys.disabled():
        print(f"\n[honest memory, mxfp4] experts {info.all_expert_bytes / 2**20:.0f} MiB, dense "
              f"{info.dense_bytes / 2**20:.0f} MiB, budget {stats['budget_bytes'] / 2**20:.0f} MiB, reported "
              f"overhead {result['engine_overhead_bytes'] / 2**20:.0f} MiB -> peak RSS "
              f"{stats['peak_rss_bytes'] / 2**20:.0f} MiB (dense + budget + reported overhead "
              f"{reported / 2**20:.0f} MiB; limit {limit / 2**20:.0f} MiB)")
    assert result["engine_overhead_bytes"] <= SLACK
    assert stats["budget_bytes"] <= info.all_expert_bytes // 4 + info.expert_bytes
    assert stats["bytes_loaded"] > 0 and stats["peak_rss_bytes"] < limit
    assert stats["peak_rss_bytes"] <= reported + NEW_SHAPES_ALLOWANCE
