"""Replies decoded together (engine.process.batch) give each the tokens it gets alone, and a long prompt
goes in chunks with the same tokens out: in-process, on tiny real checkpoints of two families."""

from __future__ import annotations

import pytest

from engine.decode.generation import GenerationResult, Generator
from engine.decode.runtime import MoERuntime
from engine.decode.sequence import PREFILL_CHUNK_TOKENS
from engine.hub.estimate import parallel_for
from engine.process.batch import Batch, Stream
from engine.process.telemetry import ReplyClock
from engine.protocol import LoadModel, SamplingSettings
from tests.helpers.checkpoints import reference_generate

FAMILIES = ["mixtral", "deepseek_v3"]
PROMPTS = [[1, 17, 42, 9, 77, 5, 63, 30, 11], [3, 5, 7], [100, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [9, 9]]
LENGTHS = [12, 5, 9, 16]


@pytest.fixture(scope="module", params=FAMILIES)
def exact_runtime(request, tiny_checkpoints):
    """Exact kernels, offloaded at 30 % from disk: replies in a batch load and evict each other's experts."""
    path = tiny_checkpoints[request.param]
    runtime = MoERuntime(LoadModel(path=str(path), budget="30%", store="disk", fast_decode=False))
    yield path, runtime
    runtime.close()


def greedy(tokens: int, stop: list[str] | None = None) -> SamplingSettings:
    return SamplingSettings(temperature=0, max_new_tokens=tokens, stop=stop or [])


def run_batch(runtime: MoERuntime, requests: list[tuple[list[int], SamplingSettings]],
              cancel_after: dict[int, int] | None = None, gather: bool = False,
              routing: bool = False, pack: bool = False,
              join_after: dict[int, int] | None = None) -> tuple[list[GenerationResult], Batch]:
    """The requests opened in one batch (together, or the one at index i after `join_after[i]`
    turns) and advanced turn by turn to their ends; the one at index i is cancelled after
    `cancel_after[i]` turns; `gather`: one-token forwards run gathered; `pack`: new prompts too, where
    their path runs them together; `routing`: the first keeps its experts per token."""
    generator = Generator(runtime)
    batch = Batch(len(requests), runtime.counters.num_layers, gather,
                  lambda: runtime.counters.end_token(), pack_prompts=pack)
    joins = join_after or {}

    def open_joining(turn: int) -> None:
        for index, (prompt, settings) in enumerate(requests):
            if joins.get(index, 0) == turn:
                sequence = generator.start(prompt, settings, keep_routing=routing and index == 0)
                batch.add(Stream(str(index), sequence, ReplyClock()))

    results: dict[int, GenerationResult] = {}
    turns, last_join = 0, max(joins.values(), default=0)

    def failed(stream, exc) -> None:
        raise exc

    while True:
        open_joining(turns)
        if not batch and turns >= last_join:
            break
        for index, after in (cancel_after or {}).items():
            if turns == after:
                batch.cancel(str(index))
        batch.turn(lambda stream: results.__setitem__(int(stream.request_id), GenerationResult.of(stream.sequence)),
                   failed)
        turns += 1
    return [results[i] for i in range(len(requests))], batch


def test_four_interleaved_replies_each_equal_the_reply_alone_and_transformers(exact_runtime):
    path, runtime = exact_runtime
    generator = Generator(runtime)
    alone = [generator.generate(prompt, greedy(n)) for prompt, n in zip(PROMPTS, LENGTHS, strict=True)]
    stop = alone[0].text[3:5]  # a stop string the first reply meets after a few tokens
    stopped_alone = generator.generate(PROMPTS[0], greedy(LENGTHS[0], [stop]))
    assert stopped_alone.finish_reason == "stop"
    requests = [(PROMPTS[0], greedy(LENGTHS[0], [stop]))] + [(p, greedy(n)) for p, n in zip(PROMPTS[1:], LENGTHS[1:],
                                                                                             strict=True)]
    together, batch = run_batch(runtime, requests)
    assert together[0].token_ids == stopped_alone.token_ids and together[0].text == stopped_alone.text
    assert together[0].finish_reason == "stop"
    for one, reply in zip(alone[1:], together[1:], strict=True):
        assert reply.token_ids == one.token_ids and reply.finish_reason == one.finish_reason == "length"
    for prompt, n, one in zip(PROMPTS[1:], LENGTHS[1:], alone[1:], strict=True):
        assert one.token_ids == reference_generate(path, prompt, n)
    sharing = batch.sharing.snapshot()
    assert sharing is not None and sharing.uses >= sharing.distinct > 0 and sharing.picks_per_expert >= 1.0
    assert [r.stats.decode_tokens for r in together] == [len(r.token_ids) for r in together]
    assert all(r.stats.hits + r.stats.misses > 0 for r in together)  # each reply's own figures


def test_cancelling_one_reply_leaves_the_others_intact(exact_runtime):
    _, runtime = exact_runtime
    requests = [(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    untouched, _ = run_batch(runtime, requests)
    cut, _ = run_batch(runtime, requests, cancel_after={3: 3})
    assert cut[3].finish_reason == "cancelled" and len(cut[3].token_ids) < LENGTHS[3]
    assert cut[3].token_ids == untouched[3].token_ids[: len(cut[3].token_ids)]
    for before, after in zip(untouched[:3], cut[:3], strict=True):
        assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason


def test_a_prompt_in_chunks_gives_the_tokens_of_the_whole_prompt(exact_runtime):
    path, runtime = exact_runtime
    prompt = [(7 * i + 3) % 120 + 1 for i in range(40)]
    generator = Generator(runtime)
    whole = generator.generate(prompt, greedy(10))
    runtime.prefill_chunk_tokens = 6  # 7 forwards for the prompt, the last of 4 tokens
    try:
        sequence = generator.start(prompt, greedy(10))
        forwards = 0
        while sequence.prefilling:
            sequence.step()
            forwards += 1
        while sequence.step():
            pass
        chunked = GenerationResult.of(sequence)
    finally:
        runtime.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS
    assert forwards == 7
    assert chunked.token_ids == whole.token_ids == reference_generate(path, prompt, 10)
    assert chunked.stats.prefill_tokens == len(prompt)


def test_parallel_is_what_was_asked_or_what_memory_holds():
    mib = 1 << 20
    assert parallel_for(3, 4096, 32768, 0) == 3  # asked: taken as it is
    assert parallel_for(0, 0, 32768, 0) == 4  # no KV cache to hold (a state-space model): the most
    # 16 KiB a token x 4096 tokens = 64 MiB a reply
    assert parallel_for(0, 16 * 1024, 32768, 200 * mib) == 3
    assert parallel_for(0, 16 * 1024, 32768, 10 * mib) == 1  # at least one
    assert parallel_for(0, 16 * 1024, 1024, 10 * 1024 * mib) == 4  # at most four


@pytest.fixture(scope="module", params=FAMILIES)
def fast_runtime(request, tiny_checkpoints, kernels):
    """The native kernels (bf16) at a budget below `all`, where decode runs layer by layer: what gathers."""
    runtime = MoERuntime(LoadModel(path=str(tiny_checkpoints[request.param]), budget="75%", store="ram",
                                   dtype="bfloat16"))
    yield runtime
    runtime.close()


def test_gathered_one_token_forwards_give_each_reply_its_tokens_alone_and_load_shared_experts_once(fast_runtime):
    runtime = fast_runtime
    generator = Generator(runtime)
    alone = [generator.generate(prompt, greedy(n), keep_routing=True) for prompt, n in zip(PROMPTS, LENGTHS, strict=True)]
    assert runtime.decode_path == "fast: native kernels, layer by layer"
    requests = [(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    loads = runtime.counters.layer_misses.sum()
    gathered, batch = run_batch(runtime, requests, gather=True, routing=True)
    assert gathered[0].routed_experts is not None  # the experts per token, kept apart in gathered layers
    assert (gathered[0].routed_experts == alone[0].routed_experts).all()
    loads_gathered = runtime.counters.layer_misses.sum() - loads
    turns, _ = run_batch(runtime, requests)  # second, so on the cache the first left: no head start
    loads_in_turns = runtime.counters.layer_misses.sum() - loads - loads_gathered
    for one, reply in zip(alone, gathered, strict=True):
        assert reply.token_ids == one.token_ids and reply.finish_reason == one.finish_reason
    assert [r.token_ids for r in turns] == [r.token_ids for r in alone]
    sharing = batch.sharing.snapshot()
    assert sharing is not None and sharing.picks_per_expert > 1.0  # replies picked the same experts in a turn
    # a gathered layer loads an expert once for every reply that picked it: never more loads than in turns,
    # where a reply's misses may evict another's experts before its turn comes
    assert loads_gathered <= loads_in_turns, (loads_gathered, loads_in_turns)
