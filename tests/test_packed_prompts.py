"""New replies' prompts in one forward (engine.decode.paths.packed_prompts, the fast prompt path's
`run_together`): each prompt gets its logits and KV cache to the prompt path's reference and
tolerance, as alone, on every family the packing lists. A reply that is not fresh, a prompt past a
sliding window, or one whose routing a trace records, is not packed. In a batch, packed prompts load
each expert once for all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.decode.generation import Generator
from engine.decode.paths.native_layers import NativePromptPath
from engine.decode.runtime import MoERuntime
from engine.decode.sequence import Sequence
from engine.protocol import LoadModel
from tests.helpers.checkpoints import FAMILIES, WIDE, save_tiny_checkpoint
from tests.helpers.numerics import close, same_top
from tests.test_batch import greedy, run_batch

pytestmark = pytest.mark.usefixtures("kernels")  # the native kernels (tests/conftest.py)

PROMPTS = [[5, 17, 33, 8, 61, 12, 40, 9, 27], [3, 5, 7], [100, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [9, 9, 1, 2, 3]]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    return {family: save_tiny_checkpoint(family, root / family, **WIDE[family]) for family in FAMILIES}


def q4_runtime(path: Path, budget: str = "all", store: str = "ram") -> MoERuntime:
    """Q4_K experts, the fast kernels: a prompt takes the native prompt path."""
    return MoERuntime(LoadModel(path=str(path), budget=budget, store=store, dtype="bfloat16", expert_format="q4_k"))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def first_forwards(runtime: MoERuntime, prompts: list[list[int]]) -> list[tuple[Sequence, object, object]]:
    """Each prompt's reply, the path its first forward takes, and that forward: the fast prompt path's
    (at `all` the whole-token step takes short prompts first), or with fast decode off the exact one."""
    generator = Generator(runtime)
    sequences = [generator.start(prompt, greedy(4)) for prompt in prompts]
    out = []
    for sequence in sequences:
        path, forward = sequence.prepare()
        if runtime.fast_decode:
            path = next(p for p in runtime.paths.paths if isinstance(p, NativePromptPath))
            assert path.unavailable(forward) is None
        out.append((sequence, path, forward))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_prompts_each_get_their_logits_and_kv_cache_to_the_reference(wide, family):
    runtime = q4_runtime(wide[family])
    try:
        with torch.inference_mode():
            runtime.set_fast_decode(False)  # the reference: transformers on the dequantized experts, each alone
            exact = first_forwards(runtime, PROMPTS)
            reference = [path.run(forward) for _, path, forward in exact]
            runtime.set_fast_decode(True)
            packed = first_forwards(runtime, PROMPTS)
            path = packed[0][1]
            assert isinstance(path, NativePromptPath)
            assert all(path.can_run_together(forward) for _, _, forward in packed)
            ran = path.run_together([forward for _, _, forward in packed])
        for row, (logits, expected) in enumerate(zip(ran.logits, reference, strict=True)):
            # the prompt path's tolerance alone (tests/test_quantized_experts.py): the experts of a
            # prompt take integer dots or tiles by their rows, each summed in its own order
            close(logits, expected, f"{family} prompt {row}", relative=0.12)
            same_top(logits, expected, f"{family} prompt {row}")
        for (one, _, _), (other, _, forward), prompt in zip(exact, packed, PROMPTS, strict=True):
            assert other.kv.get_seq_length() == len(prompt)  # its own prompt's positions, no other's
            for index, (a, b) in enumerate(zip(other.kv.layers, one.kv.layers, strict=True)):
                assert a.keys.shape == b.keys.shape
                # measured: at most 2.1 % apart (norm of the difference / norm), as alone (2.8 %)
                assert relative(a.keys, b.keys) < 0.05 and relative(a.values, b.values) < 0.05, (family, index)
            other.finish(forward, ran.logits[0])
            assert other.prepare()[1].position == len(prompt)  # its next token goes on from there
    finally:
        runtime.close()


def test_only_a_fresh_reply_within_any_sliding_window_packs(wide):
    runtime = q4_runtime(wide["gpt_oss"])  # a sliding window of 16 positions
    try:
        window = runtime.model.config.sliding_window
        (_, path, short), (_, _, long) = first_forwards(runtime, [list(range(3, 10)), list(range(3, 3 + window))])
        assert path.can_run_together(short) and not path.can_run_together(long)
        runtime.prefill_chunk_tokens = 4  # a prompt in chunks: its second chunk extends a cache
        (sequence, path, first), = first_forwards(runtime, [list(range(3, 12))])
        assert path.can_run_together(first)
        with torch.inference_mode():
            sequence.finish(first, path.run(first))
        path, second = sequence.prepare()
        assert second.prefill and not path.can_run_together(second)
    finally:
        runtime.close()


def test_prompts_go_one_at_a_time_while_a_trace_records_routing(wide, tmp_path):
    runtime = MoERuntime(LoadModel(path=str(wide["mixtral"]), budget="all", store="ram", dtype="bfloat16",
                                   expert_format="q4_k", trace=str(tmp_path / "routing.jsonl")))
    try:
        (_, path, forward), = first_forwards(runtime, PROMPTS[:1])
        assert isinstance(path, NativePromptPath) and not path.can_run_together(forward)
    finally:
        runtime.close()


def test_a_batch_packs_its_new_prompts_and_loads_their_experts_once(wide):
    # offloaded to disk at 30 %: the prompts' experts are loaded for each forward that needs them
    runtime = q4_runtime(wide["mixtral"], budget="30%", store="disk")
    try:
        requests = [(prompt, greedy(1)) for prompt in PROMPTS]
        loads = runtime.counters.layer_misses.sum()
        packed, _ = run_batch(runtime, requests, pack=True)
        loads_packed = runtime.counters.layer_misses.sum() - loads
        in_turns, _ = run_batch(runtime, requests)
        loads_in_turns = runtime.counters.layer_misses.sum() - loads - loads_packed
        assert [len(r.token_ids) for r in packed] == [len(r.token_ids) for r in in_turns] == [1] * len(PROMPTS)
        assert [r.stats.prefill_tokens for r in packed] == [len(p) for p in PROMPTS]
        # four prompts touch most experts of a layer: packed, each is loaded once for all of them
        assert loads_packed < loads_in_turns, (loads_packed, loads_in_turns)
    finally:
        runtime.close()
