"""bench.memcap's harness: a command under a cgroup memory cap where the kernel offers one, and one
line saying why not where it does not (the bench itself is slow and not run here)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from bench import cgroup_cap, memcap

MiB = 2**20


def test_the_bench_skips_with_one_line_where_no_cap_can_be_made(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(memcap, "unavailable", lambda: "no cgroup v1 memory controller here")
    assert memcap.main(["--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "memcap: skipped: no cgroup v1 memory controller here\n"
    assert not list(tmp_path.iterdir())


def test_no_controller_is_one_line(tmp_path):
    reason = cgroup_cap.unavailable(tmp_path)
    assert reason is not None and "\n" not in reason and "not measured" in reason


@pytest.mark.skipif(cgroup_cap.unavailable() is not None, reason=str(cgroup_cap.unavailable()))
def test_a_command_is_held_to_its_cap_and_the_group_goes_afterwards():
    within = cgroup_cap.run_capped([sys.executable, "-c", "b = bytearray(40 << 20); b[:] = b'x' * len(b)"],
                                   256 * MiB, timeout=60)
    assert within.ok and 40 * MiB <= within.peak_rss_bytes and 40 * MiB <= within.group_peak_bytes <= 256 * MiB
    beyond = cgroup_cap.run_capped([sys.executable, "-c", "b = bytearray(300 << 20); b[:] = b'x' * len(b)"],
                                   128 * MiB, timeout=60)
    assert not beyond.ok and beyond.oom_killed and beyond.group_peak_bytes <= 128 * MiB
    assert not list(cgroup_cap.MEMORY_V1.glob(f"moescope-memcap-{os.getpid()}-*"))


@pytest.mark.slow
@pytest.mark.skipif(cgroup_cap.unavailable() is not None, reason=str(cgroup_cap.unavailable()))
def test_the_bench_converts_and_decodes_a_small_shape_under_its_cap(tmp_path, capsys):
    assert memcap.main(["--shape", "qwen3moe-tiny", "--cap-gib", "1", "--decode", "4", "--prompt-len", "4",
                        "--skip-llama", "--out", str(tmp_path)]) == 0
    payload = json.loads(next(tmp_path.glob("memcap-*.json")).read_text())
    convert, decode = payload["rows"]["convert"], payload["rows"]["decode"]
    assert convert["returncode"] == 0 and decode["returncode"] == 0 and decode["decode_tokens_per_s"] > 0
    assert max(convert["group_peak_bytes"], decode["group_peak_bytes"]) <= 2**30
    assert "| MoEScope: decode" in capsys.readouterr().out
