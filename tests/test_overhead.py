"""The engine process's own memory: measured, reported, and kept small."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import protocol as p
from engine.cli.main import main as moescope
from tests.helpers.checkpoints import write_large_qwen3_moe
from tests.helpers.engine_events import started_client

GiB = 1024**3


@pytest.mark.process
def test_info_reports_the_engine_overhead(capsys):
    # the figure from a fresh process (this one holds the whole test session); the wording in-process
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "info", "--model", "demo", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert 0 < info["engine_overhead_bytes"] < 2 * GiB
    assert moescope(["info", "--model", "demo"]) == 0
    text = capsys.readouterr().out
    assert "engine overhead" in text and "dense + all experts + engine overhead" in text


@pytest.fixture(scope="module")
def mid_checkpoint(tmp_path_factory):
    # weights big enough to see: 96 MiB of experts, ~44 MiB of dense weights. Building the skeleton draws
    # from torch's global generator: forked, so the tests after this one see the state they always saw.
    import torch

    with torch.random.fork_rng():
        return write_large_qwen3_moe(tmp_path_factory.mktemp("mid") / "qwen3-moe-mid", layers=2, experts=16,
                                     vocab=8192)


@pytest.mark.process
def test_model_loaded_reports_the_overhead_and_a_second_load_does_not_stack(mid_checkpoint):
    client, log = started_client()
    try:
        loads = []
        for _ in range(2):
            start = log.mark()
            client.send(p.LoadModel(path=str(mid_checkpoint), budget="all"))
            loads.append(log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)), timeout=300, start=start))
        first, second = loads
        assert isinstance(first, p.ModelLoaded) and isinstance(second, p.ModelLoaded), loads
        assert 0 < first.baseline_rss_bytes <= first.overhead_bytes < 2 * GiB
        # bf16 as stored, but for the untied input embedding: left in the file's mapping, resident by the rows read
        config = json.loads((mid_checkpoint / "config.json").read_text())
        embedding = config["vocab_size"] * config["hidden_size"] * 2
        assert first.dense_bytes - embedding * 1.05 <= first.dense_resident_bytes < first.dense_bytes - embedding / 2
        weights = first.dense_resident_bytes + first.all_expert_bytes
        # the first model's weights are gone before the second loads: the overhead stays where it was
        assert second.overhead_bytes < first.overhead_bytes + weights / 4
    finally:
        client.stop()


@pytest.mark.bench
def test_the_overhead_benchmark_measures_each_point_and_writes_its_table(tmp_path):
    from bench.overhead import main

    assert main(["--models", "demo", "--out", str(tmp_path)]) == 0
    (table,) = tmp_path.glob("overhead-*.md")
    text = table.read_text()
    for point in ("+ torch", "+ generation path imports", "loaded (budget all)", "overhead while decoding"):
        assert point in text
    (result,) = json.loads(next(tmp_path.glob("overhead-*.json")).read_text())["results"]
    assert 0 < result["baseline_bytes"] <= result["overhead_at_load"] < 2 * GiB
    # a fresh engine process never imports what only a conversion needs (gguf, sentencepiece)
    assert result["lazy_modules_loaded"] == []
    # the loaded process's memory by part (smaps' mappings) adds up to its resident memory
    assert "by part" in text and "sum of parts" in text
    parts = result["parts_at_load"]
    assert abs(sum(parts["by_part"].values()) - parts["rss"]) < 16 * 2**20
    assert parts["threads"] >= 1 and parts["heap"]["in_use"] > 0


def test_the_loads_first_forward_is_not_shown_and_does_not_change_the_reply():
    # the load runs a short prompt through the decode paths (torch's first-use setup, counted in the
    # overhead); the user sees no trace of it: no tokens, hits or loads before their first request
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    prompt, greedy = [3, 17, 42, 9, 11], SamplingSettings(temperature=0, max_new_tokens=8)
    replies = []
    for warm in (True, False):
        runtime = MoERuntime(LoadModel(path="demo", budget="25%", store="disk", warm=warm))
        counters = runtime.counters
        assert counters.requests_started == 0 and not counters.recent
        assert counters.layer_hits.sum() == counters.layer_misses.sum() == counters.activation_total.sum() == 0
        assert counters.bytes_ondemand == counters.bytes_prefetch == 0
        result = Generator(runtime).generate(prompt, greedy)
        assert runtime.counters.requests_started == 1 and runtime.cache.counters is runtime.counters
        replies.append(result.token_ids)
        runtime.close()
    assert replies[0] == replies[1]



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resets the kernel's VmHWM")
def test_a_phase_peak_is_measured_apart_and_the_process_peak_is_kept():
    # the load measures its first forward's peak on its own; a reply's "peak RSS" stays the process's
    from engine.system import memory

    spike = bytearray(256 * 2**20)
    spike[:: 4096] = b"x" * len(spike[:: 4096])  # touched: resident
    high = memory.peak_rss_bytes()
    del spike
    assert memory.reset_phase_peak()
    assert memory.phase_peak_rss_bytes() < high - 128 * 2**20
    assert memory.peak_rss_bytes() >= high - 2**20  # the kernel syncs its per-thread counters lazily

def test_a_loaded_model_sits_out_the_cycle_collector_until_it_closes():
    # every full pass of the cycle collector walked the whole loaded model, and one that fell inside a
    # reply held that token up by it: after the load the model's objects are frozen out of those passes;
    # closed, they are collectable again, so that the next model does not load beside this one
    import gc
    import weakref

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    runtime = MoERuntime(LoadModel(path="demo", budget="all", store="ram"))
    model = weakref.ref(runtime.model)
    assert gc.get_freeze_count() >= sum(1 for _ in runtime.model.modules())
    reply = Generator(runtime).generate([3, 17, 42], SamplingSettings(temperature=0, max_new_tokens=4))
    assert len(reply.token_ids) == 4
    runtime.close()
    del runtime, reply
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    from bench.overhead import mappings

    return sum(m["Rss"] for m in mappings() if m["path"] == str(path))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_a_checkpoints_pages_read_for_a_copy_are_let_go_and_read_back_unchanged(tmp_path):
    # After the dense weights are copied into the huge-page arena, the checkpoint's mapping still
    # held the pages the copy read: the dense weights resident twice.
    import torch
    from safetensors.torch import load_file, save_file

    from engine.system import memory

    path = (tmp_path / "weights.safetensors").resolve()
    save_file({"w": torch.arange(8 << 20, dtype=torch.int32)}, str(path))  # 32 MiB
    weights = load_file(str(path))["w"]  # a view of the file's mapping
    expected = int(weights.sum())  # reads every page
    before = _mapped_rss(path)
    assert before > 16 << 20
    assert memory.release_file_pages([path]) >= 32 << 20
    assert _mapped_rss(path) < before / 4
    assert int(weights.sum()) == expected  # the same bytes, from the file again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")
def test_weights_left_in_a_files_mapping_count_by_the_pages_read(tmp_path):
    # An input embedding stays in the checkpoint's mapping and a token reads one row: counted whole
    # as weights, the engine's own overhead came out low by the rows never read.
    import torch
    from safetensors.torch import load_file, save_file

    from engine.system import memory

    path = tmp_path / "embedding.safetensors"
    save_file({"w": torch.zeros(4096, 2048, dtype=torch.int32)}, str(path))  # 32 MiB
    memory.release_file_pages([path])
    rows = load_file(str(path))["w"]
    assert memory.resident_bytes(rows.data_ptr(), rows.nbytes) < rows.nbytes / 8
    assert int(rows[:256].sum()) == 0  # 256 rows read: 2 MiB (the kernel maps a little around them)
    assert (2 << 20) <= memory.resident_bytes(rows.data_ptr(), rows.nbytes) < rows.nbytes / 4
    assert int(rows.sum()) == 0
    assert memory.resident_bytes(rows.data_ptr(), rows.nbytes) == rows.nbytes
