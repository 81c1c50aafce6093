"""Routing traces: recorded by the engine, read back, replayed through every policy beside Belady's MIN."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine.accounting.policies import POLICIES, make_policy
from engine.accounting.sizes import parse_budget
from engine.cli.main import main as moescope
from engine.decode.generation import Generator
from engine.decode.runtime import MoERuntime
from engine.protocol import LoadModel, SamplingSettings
from engine.traces.replay import ReplayError, belady_for, compare, replay
from engine.traces.trace import Trace, TraceError, TraceStep, read_trace
from tests.helpers.checkpoints import reference_generate
from tests.helpers.traces import hand_trace, request_types_trace, skewed_trace, write_csv, write_token_lines

PROMPTS = [[1, 17, 42, 9, 77, 5, 63, 30, 11], [1, 23, 45, 67, 8, 9, 10], [1, 50, 51, 52, 53]]
NEW_TOKENS = 40
BUDGETS = "30%,45%,60%"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_checkpoints):
    """A trace recorded by the engine: three requests to the tiny OLMoE checkpoint, with the outputs."""
    path = tmp_path_factory.mktemp("traces") / "olmoe.jsonl"
    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints["olmoe"]), budget="30%", store="disk", trace=str(path)))
    generator = Generator(runtime)
    outputs = [generator.generate(p, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)).token_ids for p in PROMPTS]
    layers = runtime.layout.num_layers
    runtime.close()
    return path, outputs, layers


def test_hand_made_trace_has_the_textbook_answer():
    trace = hand_trace()  # 0 1 2 0 1 2 0 1 2 through 2 slots
    lru = replay(trace, make_policy("lru"), [2], warm=False)
    mn = replay(trace, belady_for(trace), [2], warm=False)
    assert (lru.hits, lru.misses) == (0, 9)  # LRU always evicts the expert needed next
    assert (mn.hits, mn.misses) == (3, 6)  # MIN keeps one of them every other step
    # with the engine's warm-up (slots filled at load): LRU 2 hits, MIN (warmed with 0 and 1) 5
    assert replay(trace, make_policy("lru"), [2]).hits == 2
    assert replay(trace, belady_for(trace), [2]).hits == 5


def test_csv_trace_replays_through_the_cli(tmp_path, capsys):
    path = write_csv(hand_trace(), tmp_path / "hand.csv")
    code = moescope(["trace", "replay", str(path), "--num-layers", "1", "--num-experts", "4", "--top-k", "1",
                     "--budget", "2slots", "--policy", "lru", "--expert-bytes", "100", "--calibrate", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert (result["accesses"], result["misses"], result["hit_rate"]) == (9, 7, pytest.approx(2 / 9))
    assert result["bytes_per_token"] == pytest.approx(7 * 100 / 9)
    assert (result["belady"]["misses"], result["belady"]["hit_rate"]) == (4, pytest.approx(5 / 9))


def test_engine_records_every_layer_of_every_step(recorded, tiny_checkpoints):
    path, outputs, layers = recorded
    assert outputs[0] == reference_generate(tiny_checkpoints["olmoe"], PROMPTS[0], NEW_TOKENS)  # tracing is passive
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == "moescope-trace" and header["num_layers"] == layers and header["expert_bytes"] > 0
    trace = read_trace(path)
    assert sorted({s.request for s in trace.steps}) == [0, 1, 2]
    for request, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        steps = [s for s in trace.steps if s.request == request]
        assert len(steps) == layers * len(out)  # one prefill step + one per generated token after the first
        assert steps[0].tokens == len(prompt) and steps[0].token == 0
        assert [s.token for s in steps if s.layer == 0][1:] == list(range(len(prompt), len(prompt) + len(out) - 1))
        assert all(sum(s.counts) == s.tokens * trace.top_k for s in steps)
    # predictions: layer l's hidden state through layers l+1..l+3's routers
    first = trace.steps[0]
    assert set(first.predictions) == set(range(1, min(layers, 4)))
    assert trace.tokens == sum(len(p) + len(o) - 1 for p, o in zip(PROMPTS, outputs, strict=True))


def test_after_a_prompt_its_last_tokens_experts_stay(tmp_path, tiny_checkpoints):
    # The prompt needs more of each layer's experts than the layer has slots; LRU ranks the last
    # prompt token's experts most recent, so the waves stream them last and the first decode token
    # (which often repeats them) finds them resident.
    path = tmp_path / "prompt.jsonl"
    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints["olmoe"]), budget="30%", store="disk", trace=str(path)))
    Generator(runtime).generate(PROMPTS[0], SamplingSettings(temperature=0, max_new_tokens=1))
    resident = [set(slots) for slots in runtime.cache.directory.slot_of]
    runtime.close()
    prompt = [s for s in read_trace(path).steps if s.tokens > 1]
    assert len(prompt) == len(resident) and any(len(s.experts) > len(r) for s, r in zip(prompt, resident, strict=True))
    for step, slots in zip(prompt, resident, strict=True):
        assert step.last is not None and set(step.last) <= slots, (step.layer, step.last, slots)


def _replay_all(capsys, path, *extra: str) -> list[dict]:
    code = moescope(["trace", "replay", str(path), "--policy", "all", "--budget", BUDGETS, *extra])
    table, err = capsys.readouterr()
    assert code == 0, err
    with capsys.disabled():
        print(f"\n[trace replay] {path.name}\n{table}")
    assert code == moescope(["trace", "replay", str(path), "--policy", "all", "--budget", BUDGETS, "--json", *extra])
    out, err = capsys.readouterr()
    runs = json.loads(out)
    assert len(runs) == 3 * len(POLICIES)
    assert all(policy in table for policy in POLICIES) and "belady" in table
    return runs


def _check_belady_is_a_bound(runs: list[dict]) -> None:
    for run in runs:
        mn = run["belady"]
        assert run["total_slots"] == mn["total_slots"]
        if not POLICIES[run["policy"]].lossless:
            assert run["rerouted"] > 0  # swapmoe changes the routing instead of loading
            continue
        # nothing loads fewer experts than MIN; demand-only policies cannot hit more often either
        assert run["loads"] >= mn["loads"], run
        assert run["bytes_per_token"] >= mn["bytes_per_token"]
        if run["prefetch_loads"] == 0:
            assert run["hit_rate"] <= mn["hit_rate"] + 1e-12, run


def test_replay_every_policy_on_a_recorded_trace(recorded, capsys):
    path, _, _ = recorded
    runs = _replay_all(capsys, path)
    _check_belady_is_a_bound(runs)
    promoe = [r for r in runs if r["policy"] == "promoe"]
    assert all(r["extra"]["predicted_sets"] > 0 and 0 < r["extra"]["prediction_accuracy"] <= 1 for r in promoe)


def test_replay_every_policy_on_a_skewed_trace(tmp_path, capsys):
    trace = skewed_trace(tokens=240)
    path = write_csv(trace, tmp_path / "skewed.csv")
    runs = _replay_all(capsys, path, "--num-layers", "8", "--num-experts", "32", "--top-k", "2",
                       "--expert-bytes", str(1 << 20))
    _check_belady_is_a_bound(runs)
    lru = {r["budget"]: r["hit_rate"] for r in runs if r["policy"] == "lru"}
    assert lru["30%"] < lru["45%"] < lru["60%"]  # more memory, more hits


def test_uniform_and_planned_allocations_both_replay(recorded, capsys):
    path, _, _ = recorded
    for allocation in ("uniform", "planned"):
        assert moescope(["trace", "replay", str(path), "--budget", "40%", "--allocation", allocation, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["allocation"] == allocation and 0 <= result["hit_rate"] <= 1


@pytest.mark.parametrize(("content", "message"), [
    ('{"format": "moescope-trace", "num_layers": 2, "num_experts": 4, "top_k": 1}\nnot json\n', "line 2 is not valid JSON"),
    ('{"format": "moescope-trace", "num_layers": 2, "num_experts": 4, "top_k": 1}\n{"r":0,"t":0,"l":5,"e":[[1]]}\n',
     "has layer 5"),
    ("request,token,layer,experts\n0,0,0,9\n", "outside 0..3"),
    ("time,layer\n", "header request,token,layer,experts"),
])
def test_bad_traces_are_named(tmp_path, capsys, content, message):
    path = tmp_path / "bad.trace"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        read_trace(path, num_layers=2, num_experts=4)
    assert moescope(["trace", "replay", str(path), "--num-layers", "2", "--num-experts", "4"]) == 2
    assert message.split()[0] in capsys.readouterr().err


def test_byte_budget_needs_expert_size(tmp_path, capsys):
    path = write_csv(hand_trace(), tmp_path / "hand.csv")
    assert moescope(["trace", "replay", str(path), "--num-layers", "1", "--num-experts", "4", "--budget", "1MiB"]) == 2
    assert "--expert-bytes" in capsys.readouterr().err


# ---------------------------------------------------------------- honest scoring


def test_split_calibrates_on_whole_requests_or_first_tokens():
    several = request_types_trace(requests=12)
    head, tail = several.split(0.25)
    assert {s.request for s in head.steps} == {0, 1, 2} and {s.request for s in tail.steps} == set(range(3, 12))
    one = skewed_trace(tokens=100, requests=1)
    head, tail = one.split(0.25)
    assert (head.tokens, tail.tokens) == (25, 75) and max(s.token for s in head.steps) < min(s.token for s in tail.steps)
    assert one.split(0)[1].tokens == 100
    with pytest.raises(ValueError, match="below 100 %"):
        one.split(1)


def test_replay_scores_only_what_did_not_calibrate(tmp_path, capsys):
    trace = skewed_trace(tokens=240, requests=4)
    result = compare(trace, "lru", parse_budget("30%"), allocation="uniform")
    assert result.policy.tokens == result.belady.tokens == 180  # the first of 4 requests calibrated
    assert result.calibration == "the first 1 of 4 requests"
    path = write_csv(trace, tmp_path / "skewed.csv")
    assert moescope(["trace", "replay", str(path), "--num-layers", "8", "--num-experts", "32", "--top-k", "2",
                     "--calibrate", "50%"]) == 0
    assert "scored: 120 tokens after the first 2 of 4 requests, which calibrated" in capsys.readouterr().out


def test_replay_refuses_to_score_a_profile_policy_on_its_own_calibration(tmp_path, capsys):
    trace = skewed_trace(tokens=240, requests=4)
    path = write_csv(trace, tmp_path / "skewed.csv")
    geometry = ["--num-layers", "8", "--num-experts", "32", "--top-k", "2", "--policy", "popularity"]
    # the replayed file as its own profile: it holds the scored routing
    assert moescope(["trace", "replay", str(path), *geometry, "--profile", str(path)]) == 2
    assert "holds the routing being scored" in capsys.readouterr().err
    # nothing left to calibrate on
    assert moescope(["trace", "replay", str(path), *geometry, "--calibrate", "0"]) == 2
    assert "needs a calibration profile" in capsys.readouterr().err
    with pytest.raises(ReplayError, match="needs a calibration profile"):
        replay(trace, make_policy("popularity"), [4] * 8)  # no silent default to the trace's own counts
    # the oracle only when asked for, and labelled wherever it prints
    assert moescope(["trace", "replay", str(path), *geometry, "--calibrate", "0", "--oracle"]) == 0
    assert "popularity (oracle)" in capsys.readouterr().out
    assert moescope(["trace", "replay", str(path), *geometry, "--oracle", "--json"]) == 0
    oracle = json.loads(capsys.readouterr().out)
    assert oracle["policy"] == "popularity (oracle)" and oracle["oracle"] is True
    # honest by default: calibrated on the first request, not labelled
    assert moescope(["trace", "replay", str(path), *geometry, "--json"]) == 0
    honest = json.loads(capsys.readouterr().out)
    assert honest["policy"] == "popularity" and honest["oracle"] is False
    other = write_csv(skewed_trace(tokens=240, requests=4, seed=5), tmp_path / "other.csv")
    assert moescope(["trace", "replay", str(path), *geometry, "--profile", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "popularity"


def test_replay_reports_loads_and_ratios_to_belady(tmp_path, capsys):
    path = write_csv(skewed_trace(tokens=240), tmp_path / "skewed.csv")
    assert moescope(["trace", "replay", str(path), "--num-layers", "8", "--num-experts", "32", "--top-k", "2",
                     "--policy", "lru,promoe", "--budget", "30%", "--json"]) == 0
    for run in json.loads(capsys.readouterr().out):
        assert run["loads_vs_belady"] == pytest.approx(run["loads"] / run["belady"]["loads"])
        assert run["hit_rate_vs_belady"] == pytest.approx(run["hit_rate"] / run["belady"]["hit_rate"])
        assert run["loads_per_token"] == pytest.approx((run["misses"] + run["prefetch_loads"]) / run["tokens"])


def test_per_token_layer_lists_read_like_the_olmoe_trace(tmp_path, capsys):
    original = skewed_trace(num_layers=4, num_experts=16, top_k=3, tokens=30, requests=1)
    path = write_token_lines(original, tmp_path / "tokens.jsonl")
    trace = read_trace(path, num_experts=16)
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.tokens) == (4, 16, 3, 30)
    assert [s.experts for s in trace.steps] == [s.experts for s in original.steps]
    assert moescope(["trace", "replay", str(path), "--num-experts", "16", "--policy", "lru,markov"]) == 0
    out, err = capsys.readouterr()
    assert "after the first 8 of 30 tokens" in out and err == ""  # the count given: nothing to say


def test_a_per_token_trace_without_the_expert_count_takes_it_from_its_ids(tmp_path, capsys):
    original = skewed_trace(num_layers=4, num_experts=16, top_k=3, tokens=30, requests=1)
    highest = max(e for s in original.steps for e in s.experts)
    path = write_token_lines(original, tmp_path / "tokens.jsonl")
    assert read_trace(path).num_experts == highest + 1
    assert moescope(["trace", "replay", str(path), "--policy", "lru", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == 22  # replayed, not refused
    assert err.splitlines() == [f"moescope: note: tokens.jsonl has no header: {highest + 1} experts per layer, "
                                f"from its highest expert id ({highest}); --num-experts N says otherwise"]
    # the option still overrides, and a count the ids exceed is refused in one line
    assert read_trace(path, num_experts=64).num_experts == 64
    with pytest.raises(TraceError, match=f"names an expert outside 0..{highest - 1}"):
        read_trace(path, num_experts=highest)


OLMOE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "olmoe-1b-7b" / "trace_olmoe_299.jsonl"


@pytest.mark.skipif(not OLMOE.exists(), reason=f"the real OLMoE-1B-7B trace is not here ({OLMOE}: ../shared is absent)")
def test_real_olmoe_trace_markov_beats_lru_and_nothing_beats_belady():
    trace = read_trace(OLMOE, num_experts=64)  # sqliteai/warp tests/trace_olmoe_299.jsonl (Apache-2.0)
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.tokens) == (16, 64, 8, 299)
    for budget in ("25%", "50%"):
        lru, markov = (compare(trace, p, parse_budget(budget), allocation="uniform") for p in ("lru", "markov"))
        assert markov.policy.loads < lru.policy.loads and markov.policy.hit_rate > lru.policy.hit_rate
        assert markov.policy.loads >= markov.belady.loads and markov.policy.tokens == 224
        # crosslayer knows a layer's experts before its router runs: within 10 % of Belady's hit rate,
        # at no more than 1 % above LRU's loads (its prefetches are hits that cost a load each)
        crosslayer = compare(trace, "crosslayer", parse_budget(budget), allocation="uniform")
        assert crosslayer.policy.hit_rate >= 0.9 * crosslayer.belady.hit_rate
        assert crosslayer.belady.loads <= crosslayer.policy.loads <= 1.01 * lru.policy.loads


@pytest.mark.skipif(not OLMOE.exists(), reason=f"the real OLMoE-1B-7B trace is not here ({OLMOE}: ../shared is absent)")
def test_crosslayer_spends_no_loads_on_a_cold_start_after_a_prompt():
    # As `bench.run` drives it: a short warm-up request, then a prompt of 16 tokens and 3 decode
    # tokens of OLMoE routing. Right after a prompt markov favours what its load waves pushed out;
    # crosslayer, having learned almost nothing of the layer below, must not spend loads on that.
    rows = read_trace(OLMOE, num_experts=64)
    picks = np.array([[s.experts for s in rows.steps if s.token == t] for t in sorted({s.token for s in rows.steps})])
    steps, row = [], 0
    for request, (prompt, decode) in enumerate(((8, 1), (16, 3))):
        for layer in range(16):
            experts, counts = np.unique(picks[row:row + prompt, layer], return_counts=True)
            steps.append(TraceStep(request, 0, prompt, layer, experts.tolist(), counts.tolist(), [1.0] * len(experts)))
        row += prompt
        for t in range(decode):
            steps += [TraceStep(request, prompt + t, 1, layer, sorted(picks[row, layer].tolist()), [1] * 8, [1.0] * 8)
                      for layer in range(16)]
            row += 1
    warm, scored = Trace(16, 64, 8, steps[:32]), Trace(16, 64, 8, steps[32:])
    markov, crosslayer = (replay(scored, make_policy(p), [16] * 16, history=warm) for p in ("markov", "crosslayer"))
    assert crosslayer.loads <= markov.loads


@pytest.mark.parametrize("name", ["demo-heldout-mixed", "demo-heldout-by-skill"])
def test_committed_demo_traces_replay_with_request_structure(name):
    trace = read_trace(Path(__file__).resolve().parents[1] / "bench" / "traces" / f"{name}.jsonl")
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.requests) == (4, 8, 2, 32)
    assert all(s.predictions for s in trace.steps if s.layer == 0)  # the router lookahead promoe replays
    lru, markov = (compare(trace, p, parse_budget("50%"), allocation="uniform") for p in ("lru", "markov"))
    assert lru.calibration == "the first 8 of 32 requests"
    assert lru.belady.loads <= min(lru.policy.loads, markov.policy.loads) <= 1.3 * lru.belady.loads
    # a prompt's last token is its most recent use: without it (every prompt expert used at once)
    # both load more after each prompt (docs/performance.md)
    assert all(s.last is not None for s in trace.steps if s.tokens > 1)
    blind = Trace(trace.num_layers, trace.num_experts, trace.top_k,
                  [dataclasses.replace(s, last=None) for s in trace.steps], trace.expert_bytes)
    for policy, hinted in (("lru", lru), ("markov", markov)):
        assert compare(blind, policy, parse_budget("50%"), allocation="uniform").policy.loads > hinted.policy.loads
