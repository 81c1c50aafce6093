"""The benchmark harness end to end on a tiny checkpoint: every system measured, the limit computed,
the results written. Speed is not asserted here (benchmarks print ratios; tests check behaviour)."""

from __future__ import annotations

import json

import pytest

from bench.measure import main as measure_main
from bench.routing import OLMOE_TRACE, olmoe_choices
from bench.run import main as bench_main
from engine.traces.trace import read_trace
from tests.helpers.checkpoints import save_tiny_checkpoint

pytestmark = pytest.mark.bench


def test_harness_measures_every_system_and_the_limit(tmp_path, mixtral_checkpoint):
    out = tmp_path / "results"
    # one routing: each system is a process of its own (seconds of imports each); the test below
    # drives a replayed routing through the same harness
    code = bench_main(["--models", str(mixtral_checkpoint), "--budgets", "50,100", "--prompts", "16", "--decode", "4",
                       "--routings", "random", "--accelerate-decode", "2", "--threads", "1", "--out", str(out)])
    assert code == 0
    (report_path,) = out.glob("*.json")
    report = json.loads(report_path.read_text())
    rows = [r for r in report["rows"] if r.get("budget_pct") is not None]
    assert {(r["routing"], r["budget_pct"]) for r in rows} == {("random", 50), ("random", 100)}
    for row in rows:
        assert "error" not in row["moescope"] and "error" not in row["transformers"]
        assert row["moescope"]["decode_tokens_per_s"] > 0
        limit = row["limit"]
        # Belady's loads are a lower bound on what any cache with these slots must load.
        assert limit["belady_loads"] * row["moescope"]["slot_bytes"] <= row["moescope"]["bytes_loaded"]
    assert all("error" not in r["accelerate"] for r in rows)
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
    # and both are also held to transformers' eager attention (the two attentions can part at a near-tie)
    assert row["stock_attention"] == "sdpa" and len(row["eager_token_ids"]) == 5 and "fast_same_tokens_eager" in row
    assert prefill_pair(["--geometries", str(mixtral_checkpoint), "--prompt-len", "12", "--turns", "2",
                         "--threads", "1", "--out", str(out)]) == 0
    (prefill_report,) = out.glob("prefill-pair-*.json")
    (row,) = json.loads(prefill_report.read_text())["rows"]
    assert row["ours_tokens_per_s"] > 0 and row["stock_tokens_per_s"] > 0 and len(row["seconds"]["ours"]) == 2


@pytest.mark.skipif(not OLMOE_TRACE.exists(), reason=f"the real OLMoE-1B-7B trace is not here ({OLMOE_TRACE}: "
                    "../shared is absent)")
def test_harness_drives_the_olmoe_routing_for_each_policy(tmp_path, capsys):
    # a tiny checkpoint of OLMoE-1B-7B's MoE geometry (16 layers x 64 experts, top-8), as qwen3moe-64e has
    path = save_tiny_checkpoint("olmoe", tmp_path / "olmoe-geometry", num_hidden_layers=16, num_experts=64,
                                num_experts_per_tok=8)
    recorded = tmp_path / "routing.jsonl"
    assert measure_main(["ours", "--model", str(path), "--budget", "50%", "--prompt-len", "8", "--decode", "6",
                         "--threads", "1", "--routing", "olmoe", "--policy", "markov", "--trace-out", str(recorded)]) == 0
    run = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert run["routing_rows"] == 299 and run["hit_rate"] < 1
    real = olmoe_choices(16, 64, 8)
    decode = [s for s in read_trace(recorded).steps if s.tokens == 1]
    first = run["routing_rows_used"] - len(decode) // 16  # the rows the decode steps replayed
    assert len(decode) == 16 * 5 and all(s.experts == sorted(real[first + s.token - 8, s.layer]) for s in decode)

    out = tmp_path / "results"
    assert bench_main(["--models", str(path), "--budgets", "50,100", "--prompts", "8", "--decode", "6",
                       "--routings", "olmoe", "--policies", "lru,markov", "--skip-accelerate", "--threads", "1",
                       "--out", str(out)]) == 0
    (report_path,) = out.glob("*.json")
    rows = [r for r in json.loads(report_path.read_text())["rows"] if r.get("budget_pct") is not None]
    assert {(r["policy"], r["budget_pct"]) for r in rows} == {("lru", 100), ("lru", 50), ("markov", 50)}
    for row in rows:
        limit, ours = row["limit"], row["moescope"]
        assert ours["decode_loads_per_token"] >= limit["belady_decode_loads_per_token"]  # nothing loads fewer
        assert limit["decode_tokens_per_s"] > 0
    table = report_path.with_suffix(".md").read_text()
    assert "| olmoe (first " in table and "| markov | 50% |" in table


def test_format_quality_table_scores_each_format_against_the_float_model(tmp_path):
    from bench.lossy_cost import main as lossy_cost
    from resources import DEMO_MODEL_DIR

    out, card = tmp_path / "results", tmp_path / "moescope_demo.json"
    card.write_text((DEMO_MODEL_DIR / "moescope_demo.json").read_text())
    assert lossy_cost(["--formats", "8bit", "--n", "2", "--out", str(out), "--card", str(card)]) == 0
    (report_path,) = out.glob("format-quality-*.json")
    float_row, q8_row = json.loads(report_path.read_text())["rows"]
    assert (float_row["expert_format"], q8_row["expert_format"]) == ("original", "q8_0")
    assert float_row["kl_mean"] == 0 and float_row["same_top_token"] == 1
    assert all(d == 0 for d in float_row["delta_points"].values())
    assert 0 < q8_row["kl_mean"] < 0.01  # 8-bit blocks move the distributions, a little
    assert q8_row["experts_stored_as"] == {"gate_up_proj": "q8_0", "down_proj": "q8_0"}
    assert q8_row["decode_path"] == "exact: transformers' kernels" and q8_row["goal_points"] == 2
    header = report_path.with_suffix(".md").read_text().splitlines()[2]
    for column in ("experts", "dense", "experts stored as", "perplexity", "mean KL", "worst claimed diff", "goal",
                   "count_letters"):
        assert f"| {column} |" in header
    rows = json.loads(card.read_text())["format_quality"]["rows"]
    assert [(r["expert_format"], r["dense_format"]) for r in rows] == [("original", "original"), ("q8_0", "original")]


def test_format_quality_refuses_an_unknown_format_in_one_line(capsys):
    from bench.lossy_cost import main as lossy_cost

    with pytest.raises(SystemExit) as exit_info:
        lossy_cost(["--formats", "q9_9", "--n", "1"])
    assert "unknown weight format 'q9_9'; choose one of" in str(exit_info.value)


def test_quantized_gemv_bench_sets_integer_dots_beside_the_float_loops(tmp_path, kernels):
    from bench.quant_gemv import main as gemv_main

    assert gemv_main(["--rows", "64", "--cols", "512", "--formats", "q4_k,q5_0", "--reps", "1", "--rounds", "1",
                      "--out", str(tmp_path)]) == 0
    (payload,) = [json.loads(p.read_text()) for p in tmp_path.glob("quant-gemv-*.json")]
    assert [r["format"] for r in payload["rows"]] == ["q4_k", "q5_0"]
    for row in payload["rows"]:
        assert row["integer_weights_per_s"] > 0 and row["float_weights_per_s"] > 0
        assert row["errors"]["integer"] < 0.02 and row["errors"]["float"] < 0.02  # within bf16 output rounding
    assert "| q4_k | 4.50 |" in next(tmp_path.glob("quant-gemv-*.md")).read_text()


def test_attention_bench_sets_the_kernel_beside_torch_and_the_limit(tmp_path, kernels):
    from bench.attention import LAYOUTS
    from bench.attention import main as attention_main

    assert attention_main(["--lengths", "40", "--rounds", "1", "--cycled-mib", "1", "--out", str(tmp_path)]) == 0
    (payload,) = [json.loads(p.read_text()) for p in tmp_path.glob("attention-*.json")]
    assert [r["layout"] for r in payload["rows"]] == list(LAYOUTS)
    for row in payload["rows"]:
        assert row["ours_s"] > 0 and row["torch_s"] > 0 and row["limit_s"] > 0
        assert row["error"] < 0.02  # the same attention as torch's, within bf16 output rounding
    assert "| gpt-oss-20b (64 / 8 x 64) | 40 |" in next(tmp_path.glob("attention-*.md")).read_text()


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_the_bandwidth_limit_counts_every_byte_a_token_reads(tiny_checkpoints, family):
    # decode_pair's limit: every weight but the embedding table, biases, routers' correction
    # biases, shared experts and MLA's projections included, plus top-k routed experts per MoE
    # layer with their biases.
    import torch
    from transformers import AutoModelForCausalLM

    from bench.format_settings import active_bytes_per_token

    path = tiny_checkpoints[family]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    routed = getattr(config, "num_local_experts", None) or config.n_routed_experts
    tensors = [*model.named_parameters(), *model.named_buffers()]
    dense = sum(t.numel() * t.element_size() for name, t in tensors
                if ".experts." not in name and "embed_tokens" not in name and "rotary_emb" not in name)
    experts = sum(t.numel() * t.element_size() for name, t in model.named_parameters() if ".experts." in name)
    active, _, one_expert = active_bytes_per_token(path)
    moe_layers = sum(1 for name, _ in model.named_parameters() if name.endswith("experts.down_proj"))
    assert one_expert == experts // routed // moe_layers
    assert active == dense + config.num_experts_per_tok * one_expert * moe_layers


@pytest.mark.skipif(not OLMOE_TRACE.exists(), reason=f"the real OLMoE-1B-7B trace is not here ({OLMOE_TRACE}: "
                    "../shared is absent)")
def test_policy_cost_times_each_policy_and_leaves_its_replay_unchanged(capsys):
    from bench.policy_cost import TimedPolicy
    from bench.policy_cost import main as policy_cost
    from engine.accounting.policies import make_policy
    from engine.traces.replay import replay

    assert policy_cost(["--policies", "lru,crosslayer", "--budgets", "25%", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| lru", "| crosslayer"))]
    assert len(rows) == 2 and all(float(row.split("|")[2]) > 0 for row in rows)
    trace = read_trace(OLMOE_TRACE, num_experts=64)
    timed, plain = (replay(trace, policy, [16] * 16) for policy in (TimedPolicy(make_policy("crosslayer")),
                                                                     make_policy("crosslayer")))
    assert (timed.hits, timed.loads, timed.prefetch_loads) == (plain.hits, plain.loads, plain.prefetch_loads) != (0, 0, 0)


def test_format_speed_sets_each_picker_format_beside_the_original(tmp_path, monkeypatch):
    from bench.format_speed import main as format_speed_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the conversions, out of the user's cache
    out = tmp_path / "results"
    code = format_speed_main(["--model", "demo", "--formats", "original,q4_k,q4_k@torch", "--rounds", "2",
                              "--decode", "4", "--threads", "1", "--out", str(out)])
    assert code == 0
    (report_path,) = out.glob("*.json")
    rows = {r["format"]: r for r in json.loads(report_path.read_text())["rows"]}
    assert list(rows) == ["original", "q4_k", "q4_k@torch"]
    assert rows["original"]["over_original"] == 1.0
    assert all(len(r["rates"]) == 2 and r["decode_tokens"] > 0 for r in rows.values())


@pytest.mark.skipif(not OLMOE_TRACE.exists(), reason=f"the real OLMoE-1B-7B trace is not here ({OLMOE_TRACE}: "
                    "../shared is absent)")
def test_batch_loads_replays_replies_in_turn_and_together(tmp_path):
    from bench.batch_loads import BELADY, in_turn, main, streams_of, together

    trace = read_trace(OLMOE_TRACE, num_experts=64)
    parts = streams_of(trace, 4)
    side = together(trace, parts)
    assert in_turn(trace, parts).tokens == side.tokens == 4 * len(parts[0])
    first = next(s for s in side.steps if s.token == 0 and s.layer == 0)
    picks = [e for part in parts for e in part[0][0]]
    # an expert several replies picked is one expert of the step, counted once per reply that picked it
    assert first.experts == sorted(set(picks)) and sum(first.counts) == len(picks) == 32
    assert main(["--budgets", "50%", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("batch-loads-*.json")).read_text())
    assert {row["policy"] for row in result["rows"]} >= {"lru", "lfu", BELADY}
    assert all(row["in_turn"] > 0 and row["together"] > 0 for row in result["rows"])
    best = {way: min(row[way] for row in result["rows"]) for way in ("in_turn", "together")}
    optimum = next(row for row in result["rows"] if row["policy"] == BELADY)
    assert optimum["in_turn"] == best["in_turn"] and optimum["together"] == best["together"]  # none beats it
    assert result["picks_per_layer"] / result["union_per_layer"] > 1  # the replies share experts


@pytest.mark.usefixtures("kernels")
def test_prompt_rows_times_a_prompt_as_rows_and_on_the_prompt_path(tmp_path):
    from bench.prompt_rows import main

    assert main(["--model", "demo", "--lengths", "4,12", "--repetitions", "1", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("prompt-rows-*.json")).read_text())
    assert [row["length"] for row in result["rows"]] == [4, 12]
    for row in result["rows"]:  # both ways ran (or the table says why not), and the ratio is theirs
        assert row["unavailable"] or (row["rows_ms"] > 0 and row["prompt path_ms"] > 0
                                      and row["prompt_path_over_rows"] > 0)
    assert "prompt path / rows" in next(tmp_path.glob("prompt-rows-*.md")).read_text()
