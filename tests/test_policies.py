"""Cache policies: every lossless one keeps generation exact; prefetching and prediction are measured;
SwapMoE is lossy and says so; the load queue orders exact before speculative work."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bench.perplexity import perplexity
from engine.accounting.directory import CacheDirectory, NoFreeSlotError
from engine.accounting.policies import LOSSLESS, POLICIES, PolicyError, make_policy
from engine.accounting.routing import RoutingStep
from engine.accounting.sizes import parse_budget
from engine.cli.main import main as moescope
from engine.decode.generation import Generator
from engine.decode.runtime import MoERuntime
from engine.offload.loads import ChunkScheduler, LoadJob
from engine.protocol import LoadModel, SamplingSettings
from engine.traces.replay import belady_for, compare, replay
from engine.traces.trace import Trace, TraceStep
from tests.helpers.checkpoints import FAMILIES, reference_generate
from tests.helpers.traces import cycle_trace, layer_pair_trace, request_types_trace

PROMPT = [1, 17, 42, 9, 77, 5, 63, 30, 11]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_checkpoints) -> dict[str, list[int]]:
    return {family: reference_generate(path, PROMPT, NEW_TOKENS) for family, path in tiny_checkpoints.items()}


def generate_json(capsys, path, budget: str, policy: str, *extra: str) -> dict:
    args = ["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--raw",
            "--max-new-tokens", str(NEW_TOKENS), "--store", "disk", "--json", "--policy", policy,
            "--budget", "1" if budget == "min" else budget, *extra]
    code = moescope(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- exactness


def test_every_policy_is_listed_and_swapmoe_says_lossy(capsys):
    assert set(POLICIES) == {"lru", "lfu", "markov", "crosslayer", "popularity", "eam", "promoe", "swapmoe"}
    assert LOSSLESS == ["lru", "lfu", "markov", "crosslayer", "popularity", "eam", "promoe"]
    assert POLICIES["swapmoe"].lossless is False and "LOSSY" in POLICIES["swapmoe"].description
    assert moescope(["policies"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in POLICIES) and "LOSSY" in listing


@pytest.mark.parametrize("budget", ["min", "30%"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("policy", LOSSLESS)
def test_lossless_policies_keep_greedy_generation_exact(capsys, tiny_checkpoints, references, policy, family, budget):
    result = generate_json(capsys, tiny_checkpoints[family], budget, policy)
    assert result["token_ids"] == references[family]
    assert result["stats"]["misses"] > 0  # the cache really was too small


@pytest.mark.parametrize("spec", ["promoe:k=1", "promoe:k=3", "eam:collection_size=2,depth=1"])
def test_policy_options_stay_exact(capsys, mixtral_checkpoint, references, spec):
    assert generate_json(capsys, mixtral_checkpoint, "min", spec)["token_ids"] == references["mixtral"]


def test_bad_policy_names_are_refused(capsys, mixtral_checkpoint):
    with pytest.raises(SystemExit):
        moescope(["generate", "--model", str(mixtral_checkpoint), "--prompt-ids", "1,2", "--policy", "mru"])
    assert "unknown policy 'mru'" in capsys.readouterr().err
    with pytest.raises(PolicyError, match="does not take"):
        make_policy("lru:k=2")


def test_switching_policies_mid_reply_stays_exact(mixtral_checkpoint):
    expected = reference_generate(mixtral_checkpoint, PROMPT, 20)
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="1", store="disk", policy="lru"))
    order = iter(["eam", "promoe", "popularity", "markov", "crosslayer", "lfu", "promoe:k=1", "lru"])
    tokens: list[int] = []
    seen: list[tuple[str, np.ndarray]] = []

    def between_tokens() -> bool:
        if len(tokens) % 2 == 0:  # 10 switches in 20 tokens: every policy, some twice
            before = runtime.cache.resident_matrix()
            runtime.set_policy(next(order, "eam"))
            seen.append((runtime.cache.policy.name, before == runtime.cache.resident_matrix()))
        return False

    result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=20), on_token=tokens.append,
                                         between_tokens=between_tokens)
    runtime.close()
    assert result.token_ids == expected
    assert [name for name, _ in seen][:7] == ["eam", "promoe", "popularity", "markov", "crosslayer", "lfu", "promoe"]
    assert all(same.all() for _, same in seen)  # switching keeps what is resident


@pytest.mark.parametrize("store", ["disk", "ram"])
@pytest.mark.parametrize("policy", ["promoe", "eam", "popularity", "markov", "crosslayer", "crosslayer:margin=0.2"])
def test_budget_changes_mid_reply_stay_exact(tiny_checkpoints, policy, store):
    path = tiny_checkpoints["qwen2_moe"]
    expected = reference_generate(path, PROMPT, 20)
    runtime = MoERuntime(LoadModel(path=str(path), budget="30%", store=store, policy=policy))
    tokens: list[int] = []
    slots: list[int] = []

    def between_tokens() -> bool:
        if len(tokens) in (3, 8, 14):  # down to the minimum, up past the start, down again
            runtime.set_budget({3: "1", 8: "60%", 14: "20%"}[len(tokens)])
            slots.append(sum(runtime.cache.slots_per_layer))
        return False

    result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=20), on_token=tokens.append,
                                         between_tokens=between_tokens)
    stats = runtime.policy_stats()
    runtime.close()
    assert result.token_ids == expected
    assert slots[0] < slots[1] and slots[2] < slots[1]
    # with prefetches in flight (crosslayer prefetches on this tiny model only below its default margin)
    assert stats.get("prefetch_issued", 0) > 0 or policy == "crosslayer" or not make_policy(policy).prefetches


# ---------------------------------------------------------------- what the policies report


def test_promoe_reports_prediction_accuracy_and_goodpred(mixtral_checkpoint):
    runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget="1", store="disk", policy="promoe:k=1"))
    Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
    stats = runtime.policy_stats()
    runtime.close()
    assert stats["predicted_sets"] > 0
    assert 0.0 < stats["prediction_accuracy"] <= 1.0
    assert stats["prefetch_issued"] > 0
    assert stats["goodpred"] == pytest.approx(stats["prefetch_hits"] / stats["prefetch_issued"])
    # every prefetch ends up used in time, used late, wasted, or still resident unused
    used = stats["prefetch_hits"] + stats["prefetch_late"] + stats["prefetch_wasted"]
    assert used <= stats["prefetch_issued"]


def test_eam_uses_its_request_matrix_collection():
    trace = request_types_trace()
    budget = parse_budget("24slots")
    with_collection = compare(trace, "eam", budget, allocation="uniform").policy
    without = compare(trace, "eam:collection_size=0", budget, allocation="uniform").policy
    figures = with_collection.extra
    assert figures["eamc_size"] == 11  # 12 requests; the last one is still running
    assert figures["eamc_matched_predictions"] > 0 and figures["eamc_similarity"] > 0.5
    # matched past requests predict the next layers: prefetch hits (counted apart from plain hits) ...
    assert with_collection.prefetch_hits > 0 and without.prefetch_hits == 0
    # ... which turn demand misses into hits
    assert with_collection.misses < without.misses
    assert with_collection.hit_rate > without.hit_rate


def test_eam_collection_is_bounded_and_replaces_the_most_similar():
    policy = make_policy("eam:collection_size=2")
    policy.reset(1, 4, 1)
    for experts in ([0], [0], [3]):  # two identical requests, then a different one
        policy.on_request_start()
        policy.on_access(RoutingStep.of_layer(0, experts, [5]))
    policy.on_request_start()
    assert policy.collection_len == 2
    stored = {tuple(np.flatnonzero(m[0])) for m in policy.collection}
    assert stored == {(0,), (3,)}  # the duplicate was replaced, the distinct one kept


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_a_whole_token_of_accesses_at_once_leaves_the_state_of_layer_by_layer(name):
    # The whole-token path tells the policy a token's accesses as one step of every layer; what it
    # then evicts must be what the per-layer steps would have made it evict.
    rng = np.random.default_rng(3)
    layers, experts, top_k = 4, 12, 2
    by_layer, at_once = make_policy(name), make_policy(name)
    for policy in (by_layer, at_once):
        policy.reset(layers, experts, top_k)
        policy.set_capacity([experts] * layers)
        for layer in range(layers):
            for e in range(experts):
                policy.on_insert(layer, e)
    for _ in range(30):
        picks = np.sort(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]), axis=1)
        for layer, row in enumerate(picks.tolist()):
            by_layer.on_access(RoutingStep.of_layer(layer, row))
        at_once.on_access(RoutingStep.of_token(picks))
    everyone = list(range(experts))
    for layer in range(layers):
        for keep in range(experts - 1):
            candidates = everyone[keep:]
            assert by_layer.choose_victim(layer, candidates) == at_once.choose_victim(layer, candidates)


def test_lfu_evicts_the_least_frequently_used():
    policy = make_policy("lfu")
    policy.reset(1, 8, 1)
    d = CacheDirectory([2], policy)
    for e in (0, 0, 0, 1):
        misses = d.lookup(RoutingStep.of_layer(0, [e]))[0].missing
        for m in misses:
            d.assign(0, m, {m})
    misses = d.lookup(RoutingStep.of_layer(0, [2]))[0].missing
    _, evicted = d.assign(0, 2, {2})
    assert evicted == 1  # used once, although more recently than expert 0


def test_a_prompt_wider_than_the_slots_leaves_what_the_policy_wants_most():
    # One layer, 4 slots. A prompt needs experts 0-7; then the reply's tokens need 1 and 2. In id
    # order the last wave (4-7) stayed; in the policy's order the experts it wants most stay, and
    # resident ones it wants are held through the waves instead of being streamed out and back.
    steps = [TraceStep(0, 0, 8, 0, list(range(8)), [1] * 8, [1.0] * 8)]
    steps += [TraceStep(0, 8 + t, 1, 0, [1, 2], [1, 1], [1.0, 1.0]) for t in range(3)]
    trace = Trace(1, 8, 2, steps)
    by_id, ranked = (replay(trace, belady_for(trace), [4], ranked_waves=r) for r in (False, True))
    assert by_id.misses == 4 + 2 and ranked.misses == 4  # the 4 not resident at the start, and 1, 2 again by id
    policy = make_policy("lru")
    policy.reset(1, 8, 2)
    d = CacheDirectory([4], policy)
    for e in (1, 2, 3, 0):  # 0 the most recently used, then 3, 2, 1
        d.assign(0, e, ())
        d.lookup(RoutingStep.of_layer(0, [e]))
    d.lookup(RoutingStep.of_layer(0, [5, 6]))  # 5 and 6 used after them: LRU ranks them highest
    order, held = d.wave_order(0, list(range(8)), [4, 5, 6, 7])
    assert order[-2:] == [5, 6] and len(held) == 2 and held <= {0, 1, 2, 3}


def test_a_prompts_last_token_is_its_most_recent_use():
    step = RoutingStep.of_layer(0, [0, 1, 2, 3, 4, 5], [3, 1, 1, 1, 1, 3], tokens=6, last=[5, 0, 7])
    assert step.last.tolist() == [[0, 5]]  # sorted, and only experts the step needed
    assert RoutingStep.of_layer(0, [2, 4], tokens=1, last=[2, 4]).last is None  # one token: its own experts
    for name in ("lru", "markov"):
        policy = make_policy(name)
        policy.reset(1, 8, 2)
        d = CacheDirectory([2], policy)
        d.lookup(step)
        order, _ = d.wave_order(0, list(range(6)), list(range(6)))
        assert set(order[-2:]) == {0, 5}, name  # streamed last, so they stay


def test_markov_learns_which_expert_follows_and_beats_lru():
    trace = cycle_trace(cycles=20)  # 0 1 2 0 1 2 ... through 2 slots
    lru = replay(trace, make_policy("lru"), [2], warm=False)
    markov = replay(trace, make_policy("markov"), [2], warm=False)
    best = replay(trace, belady_for(trace), [2], warm=False)
    assert lru.hits == 0  # LRU always evicts the expert needed next
    # once it has seen each transition, markov keeps the expert that follows the one just used: it
    # misses every other step, as Belady's MIN does
    assert best.misses == 31 and markov.misses <= best.misses + 3
    assert markov.hit_rate > 0.45


def test_markov_adapts_its_decay_per_layer():
    policy = make_policy("markov")
    policy.reset(2, 16, 1)
    rng = np.random.default_rng(0)
    for t in range(400):  # layer 0 keeps one favourite; layer 1 moves to a new one every 8 steps
        favourite = [0, 1 + (t // 8) % 15]
        noise = rng.integers(1, 16, size=2)
        picks = [[int(f) if rng.random() < 0.7 else int(n)] for f, n in zip(favourite, noise, strict=True)]
        policy.on_access(RoutingStep.of_token(np.array(picks)))
        policy.on_token_end()
    assert policy.decay_in_use(0) > policy.decay_in_use(1)  # the long memory where routing stays put
    for spec, message in (("markov:weight=-1", "weight >= 0"), ("markov:decay=1", "0 < decay < 1"),
                          ("markov:memory=2", "0 <= memory < 1")):
        with pytest.raises(ValueError, match=message):
            make_policy(spec)


def test_crosslayer_prefetches_what_the_layer_below_foretells_and_beats_lru():
    # Layer 0 picks at random and layer 1 runs its pick's partner: layer 1's own history says nothing,
    # so no demand policy hits there more often than its 2 slots of 8 allow; the layer below says it all.
    trace = layer_pair_trace(tokens=400)
    lru = replay(trace, make_policy("lru"), [2, 2], warm=False)
    markov = replay(trace, make_policy("markov"), [2, 2], warm=False)
    crosslayer = replay(trace, make_policy("crosslayer"), [2, 2], warm=False)
    assert crosslayer.hit_rate > lru.hit_rate + 0.15 and crosslayer.hit_rate > markov.hit_rate + 0.15
    assert crosslayer.prefetch_hits == crosslayer.prefetch_loads > 100  # every prefetch was needed
    assert crosslayer.extra["prefetch_wasted"] == 0 and crosslayer.extra["crosslayer_precision"] > 0.8
    assert crosslayer.loads <= markov.loads + 5 and crosslayer.loads <= lru.loads * 1.03  # hits, not extra loads
    for spec, message in (("crosslayer:margin=1", "0 <= margin < 1"), ("crosslayer:witnesses=-1", "witnesses >= 0"),
                          ("crosslayer:prior=0", "prior > 0")):
        with pytest.raises(ValueError, match=message):
            make_policy(spec)


def test_crosslayer_guesses_from_the_same_token_only():
    # Layer 1's guess comes from layer 0 of the same decode token: nothing is prefetched for layer 1
    # once the token has ended, nor after a prompt step.
    trace = layer_pair_trace(tokens=400)
    partner = {a.experts[0]: b.experts[0] for a, b in zip(trace.steps[::2], trace.steps[1::2], strict=True)}
    policy = make_policy("crosslayer")
    policy.reset(2, 8, 1)
    policy.set_capacity([2, 2])
    for a, b in zip(trace.steps[::2], trace.steps[1::2], strict=True):
        policy.on_access(RoutingStep.of_layer(0, a.experts))
        policy.on_access(RoutingStep.of_layer(1, b.experts))
        policy.on_token_end()
    policy.on_access(RoutingStep.of_layer(0, [2]))
    assert policy.prefetch(0)[0] == (1, partner[2])
    policy.on_token_end()
    assert policy.prefetch(0) == []
    policy.on_access(RoutingStep.of_layer(0, [2, 4], tokens=9))
    assert policy.prefetch(0) == []


def test_a_fine_tune_is_calibrated_on_its_own_routing(tmp_path):
    """Two checkpoints of one architecture (a base model and its fine-tune share the fingerprint)
    each get their own popularity profile, and a model's second load reuses its own."""
    from tests.helpers.checkpoints import save_tiny_checkpoint

    def profile_note(path) -> str:
        runtime = MoERuntime(LoadModel(path=str(path), budget="30%", store="ram", policy="popularity"))
        runtime.close()
        return runtime.profile_note

    base, tuned = (save_tiny_checkpoint("mixtral", tmp_path / name, seed=seed) for seed, name in enumerate(("base", "tuned")))
    notes = [profile_note(base), profile_note(tuned), profile_note(base)]
    assert notes[0].startswith("calibrated") and notes[1].startswith("calibrated")  # not the base model's
    assert notes[0].rpartition(" ")[2] != notes[1].rpartition(" ")[2]  # two profile files
    assert notes[2] == f"popularity profile from {notes[0].rpartition(' ')[2]}"


def test_popularity_pins_the_profile_favourites():
    policy = make_policy("popularity")
    policy.reset(1, 8, 1)
    d = CacheDirectory([3], policy)
    policy.set_profile(np.array([[0, 9, 0, 0, 0, 7, 0, 0]]))
    assert policy.pinned[0] == {1, 5} and policy.preferred(0)[:2] == [1, 5]
    for e in (1, 5, 2):
        d.assign(0, e, {e})
    for e in (3, 4, 6, 7):  # a stream of other experts only ever evicts the unpinned slot
        d.lookup(RoutingStep.of_layer(0, [e]))
        _, evicted = d.assign(0, e, {e})
        assert evicted not in (1, 5)
    assert {1, 5} <= set(d.resident(0))


# ---------------------------------------------------------------- swapmoe (lossy)


def test_swapmoe_routes_only_among_residents_and_is_exact_with_everything_resident(mixtral_checkpoint, references):
    for budget, exact in (("all", True), ("1", False)):
        runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget=budget, store="disk", policy="swapmoe"))
        result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
        stats = runtime.policy_stats()
        runtime.close()
        assert result.stats.misses == 0  # the router never asks for a non-resident expert
        if exact:
            assert result.token_ids == references["mixtral"] and stats["rerouted_share"] == 0
        else:
            assert stats["rerouted_share"] > 0


def test_perplexity_through_the_engine(mixtral_checkpoint):
    from transformers import AutoModelForCausalLM

    ids = [1, *torch.randint(7, 100, (48,), generator=torch.Generator().manual_seed(0)).tolist()]
    model = AutoModelForCausalLM.from_pretrained(mixtral_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        exact = math.exp(float(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss))
    results = {}
    for policy, budget in (("lru", "1"), ("swapmoe", "all"), ("swapmoe", "1")):
        runtime = MoERuntime(LoadModel(path=str(mixtral_checkpoint), budget=budget, store="disk", policy=policy))
        results[policy, budget] = perplexity(runtime, ids)
        runtime.close()
    assert results["lru", "1"] == pytest.approx(exact, rel=1e-4)  # lossless at the minimum budget
    assert results["swapmoe", "all"] == pytest.approx(exact, rel=1e-4)
    assert results["swapmoe", "1"] != pytest.approx(exact, rel=1e-3)  # virtual experts cost quality


# ---------------------------------------------------------------- prefetch machinery


def test_exact_loads_preempt_speculative_ones_between_chunks():
    s = ChunkScheduler()
    spec = LoadJob(0, 1, 0, chunks=3, speculative=True)
    s.push(spec)
    moving = s.next()
    assert moving is spec  # a worker starts moving the prefetch's first chunk
    exact = LoadJob(0, 2, 1, chunks=3, speculative=False)
    s.push(exact)  # an exact miss arrives meanwhile
    s.push(spec, front=True)  # the prefetch's chunk is done; it goes back to the head of its queue
    assert s.next() is exact  # the exact job waited for one chunk only
    s.push(exact, front=True)
    assert s.next() is exact  # and keeps priority until it is done
    assert s.next() is spec


def test_needed_prefetch_is_promoted_and_unneeded_one_cancelled():
    s = ChunkScheduler()
    a, b, c = (LoadJob(0, e, e, chunks=2, speculative=True) for e in range(3))
    for job in (a, b, c):
        s.push(job)
    s.promote(c)  # layer 0 turned out to need expert 2
    assert s.next() is c
    assert s.remove(b) and not s.remove(b)
    assert s.next() is a and s.next() is None


def test_prefetch_never_takes_protected_or_loading_slots():
    policy = make_policy("lru")
    policy.reset(2, 8, 1)
    d = CacheDirectory([2, 2], policy)
    for layer in (0, 1):
        for e in (0, 1):
            d.assign(layer, e, ())
    d.assign(1, 2, {1}, pending=True)  # layer 1: expert 2 is loading into expert 0's old slot
    assert d.place_prefetches([(0, 5), (0, 6)], protected={0: {0, 1}}) == []  # layer 0 is computing 0 and 1
    assert d.place_prefetches([(1, 7)], protected={1: {1}}) == []  # 1 is needed, 2 is loading
    placed = d.place_prefetches([(1, 7)], protected={})
    assert [(lyr, e) for lyr, e, _ in placed] == [(1, 7)] and d.resident(1) == [2, 7]
    with pytest.raises(NoFreeSlotError):
        d.assign(1, 3, ())  # both of layer 1's slots are loading: the cache must cancel a prefetch first
    d.abort(1, 7)
    assert d.assign(1, 3, ())[1] == -1  # the cancelled prefetch's slot is free again
    assert d.prefetch.issued == 1 and d.prefetch.wasted == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_execution_of_misses_on_gpu(tiny_checkpoints, references):
    for family in ("mixtral", "gpt_oss"):
        runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints[family]), budget="1", store="ram",
                                         device="cuda", cpu_experts="auto", dtype="float32"))
        result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
        stats = runtime.policy_stats()
        runtime.close()
        assert "cpu_expert_runs" in stats
        assert result.token_ids == references[family]  # tiny models: far from ties, so equal despite last bits


def test_cpu_experts_flag_is_a_no_op_without_a_gpu(capsys, mixtral_checkpoint, references):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = generate_json(capsys, mixtral_checkpoint, "min", "lru", "--cpu-experts", "auto")
    assert result["token_ids"] == references["mixtral"]


def test_eam_replay_is_deterministic():
    trace = request_types_trace(requests=4)
    a = replay(trace, make_policy("eam"), [3] * trace.num_layers)
    b = replay(trace, make_policy("eam"), [3] * trace.num_layers)
    assert a.as_dict() == b.as_dict()
