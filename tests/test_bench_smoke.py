"""The benchmark harness end to end on a tiny checkpoint: every system measured, the limit computed,
the results written. Speed is not asserted here (benchmarks print ratios; tests check behaviour)."""

from __future__ import annotations

import json

import pytest

from bench.run import main as bench_main

pytestmark = pytest.mark.bench


def test_harness_measures_every_system_and_the_limit(tmp_path, mixtral_checkpoint):
    out = tmp_path / "results"
    code = bench_main(["--models", str(mixtral_checkpoint), "--budgets", "50,100", "--prompts", "16", "--decode", "4",
                       "--accelerate-decode", "2", "--threads", "1", "--out", str(out)])
    assert code == 0
    (report_path,) = out.glob("*.json")
    report = json.loads(report_path.read_text())
    rows = [r for r in report["rows"] if r.get("budget_pct") is not None]
    assert {(r["routing"], r["budget_pct"]) for r in rows} == {("random", 50), ("random", 100), ("trace", 50),
                                                                ("trace", 100)}
    for row in rows:
        assert "error" not in row["moescope"] and "error" not in row["transformers"]
        assert row["moescope"]["decode_tokens_per_s"] > 0
        limit = row["limit"]
        # Belady's loads are a lower bound on what any cache with these slots must load.
        assert limit["belady_loads"] * row["moescope"]["slot_bytes"] <= row["moescope"]["bytes_loaded"]
    assert all("error" not in r["accelerate"] for r in rows if r["routing"] == "random")
    nocache = [r["nocache"] for r in report["rows"] if r.get("budget_pct") is None]
    assert nocache and all(r["hit_rate"] == 0.0 for r in nocache)
    table = report_path.with_suffix(".md").read_text()
    assert "| mixtral |" in table and "no cache" in table


def test_token_by_token_limit_and_prefill_pairs_run_and_report(tmp_path, mixtral_checkpoint):
    from bench.decode_pair import main as decode_pair
    from bench.prefill_pair import main as prefill_pair

    out = tmp_path / "results"
    assert decode_pair(["--geometries", str(mixtral_checkpoint), "--prompt-len", "12", "--decode", "5", "--reps", "1",
                        "--threads", "1", "--out", str(out)]) == 0
    (pair_report,) = out.glob("decode-pair-*.json")
    (row,) = json.loads(pair_report.read_text())["rows"]
    for mode in ("exact", "fast", "stock"):
        assert row[f"{mode}_share"] > 0 and row[f"{mode}_tokens_per_s"] > 0
        (run,) = row["runs"][mode]
        assert len(run["token_ids"]) == 5
    assert row["exact_same_tokens"]  # the exact engine answers as transformers does
    assert prefill_pair(["--geometries", str(mixtral_checkpoint), "--prompt-len", "12", "--turns", "2",
                         "--threads", "1", "--out", str(out)]) == 0
    (prefill_report,) = out.glob("prefill-pair-*.json")
    (row,) = json.loads(prefill_report.read_text())["rows"]
    assert row["ours_tokens_per_s"] > 0 and row["stock_tokens_per_s"] > 0 and len(row["seconds"]["ours"]) == 2
