"""The engine process, through the client the GUI uses: a real spawned worker and a tiny checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine import protocol as p
from engine.cli.main import main as moescope
from tests.helpers.checkpoints import reference_generate, save_tiny_checkpoint
from tests.helpers.engine_events import started_client

pytestmark = pytest.mark.process

PROMPT_IDS = [1, 23, 45, 67, 8, 9, 10]


@pytest.fixture(scope="module")
def endless_checkpoint(tmp_path_factory):
    """No EOS id: replies run to max_new_tokens, so mid-reply actions always have a reply to act on."""
    return save_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("endless") / "mixtral", eos_token_id=None)


def loaded_engine(checkpoint, parallel: int = 0):
    client, log = started_client()
    client.send(p.LoadModel(path=str(checkpoint), budget="all", store="disk", parallel=parallel))
    loaded = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
    assert isinstance(loaded, p.ModelLoaded), loaded
    yield client, log
    client.stop()


@pytest.fixture(scope="module")
def engine(endless_checkpoint):
    """One engine process for the tests that leave it as they found it (each with request ids of its
    own): starting one and loading the model takes seconds."""
    yield from loaded_engine(endless_checkpoint)


@pytest.fixture
def own_engine(endless_checkpoint):
    """An engine process for a test that kills it."""
    yield from loaded_engine(endless_checkpoint)


@pytest.fixture
def one_at_a_time_engine(endless_checkpoint):
    """An engine that decodes one API reply at a time (`--parallel 1`)."""
    yield from loaded_engine(endless_checkpoint, parallel=1)


def done_for(log, rid: str, start: int = 0, timeout: float = 60):
    return log.wait_for(lambda e: isinstance(e, p.Done) and e.request_id == rid, timeout, start)


def test_streamed_reply_equals_the_cli(engine, endless_checkpoint, capsys):
    client, log = engine
    client.send(p.Generate("r1", messages=[{"role": "user", "content": "Hello there"}],
                           sampling=p.SamplingSettings(temperature=0, max_new_tokens=20)))
    done = done_for(log, "r1")
    streamed = "".join(e.text for e in log.of(p.Token) if e.request_id == "r1")
    assert streamed == done.text
    assert len(done.token_ids) == 20 and done.finish_reason == "length"
    capsys.readouterr()
    assert moescope(["generate", "--model", str(endless_checkpoint), "--prompt", "Hello there",
                     "--max-new-tokens", "20", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["text"] == done.text and cli["token_ids"] == done.token_ids


def test_cancel_stops_within_a_token_and_the_next_request_works(engine):
    client, log = engine
    # The cancel is in the pipe before the first forward: the worker reads it before the next one
    # (here the prompt's, or the first token's if the reply opened before the cancel arrived).
    # (Sending it on the Nth streamed token instead races the reader thread against a tiny model's
    # ~1 ms tokens, so how many more tokens come depends on the machine's load, not on the worker.)
    client.send(p.Generate("long", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=200)))
    client.send(p.Cancel("long"))
    done = done_for(log, "long")
    assert done.finish_reason == "cancelled"
    assert len(done.token_ids) <= 2
    client.send(p.Generate("next", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=5)))
    assert done_for(log, "next").finish_reason == "length"


def test_budget_change_mid_reply_shows_in_the_next_snapshot_and_stays_exact(engine, endless_checkpoint):
    client, log = engine
    expected = reference_generate(endless_checkpoint, PROMPT_IDS, 40)
    loaded = log.of(p.ModelLoaded)[0]
    sent = threading.Event()
    original = client.on_event

    def shrink_on_fifth_token(event) -> None:
        original(event)
        tokens = len([e for e in log.of(p.Token) if e.request_id == "b"])
        if isinstance(event, p.Token) and not sent.is_set() and tokens >= 5:
            sent.set()
            client.send(p.SetBudget("1"))  # below the minimum: clamped

    client.on_event = shrink_on_fifth_token
    mark = log.mark()
    client.send(p.Generate("b", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=40)))
    changed = log.wait_for(lambda e: isinstance(e, p.BudgetChanged), start=mark)
    after = log.events.index(changed)
    snapshot = log.wait_for(lambda e: isinstance(e, p.TelemetrySnapshot), start=after)
    done = done_for(log, "b", mark)
    client.on_event = original
    minimum = [loaded.top_k] * loaded.num_layers
    assert changed.slots_per_layer == minimum and "minimum" in changed.note
    assert snapshot.slots_per_layer == minimum and snapshot.state == "decoding"
    assert done.token_ids == expected
    mark = log.mark()
    client.send(p.SetBudget("all"))  # as the module's engine was loaded
    log.wait_for(lambda e: isinstance(e, p.BudgetChanged), start=mark)


def test_sigkill_mid_reply_is_reported_and_restart_reloads(own_engine):
    client, log = own_engine
    killed = threading.Event()
    original = client.on_event

    def kill_on_second_token(event) -> None:
        original(event)
        if isinstance(event, p.Token) and event.request_id == "k" and not killed.is_set():
            killed.set()
            killed.at = time.monotonic()
            os.kill(client.pid, signal.SIGKILL)

    client.on_event = kill_on_second_token
    client.send(p.Generate("k", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=500)))
    crash = log.wait_for(lambda e: isinstance(e, p.Error) and e.kind == "engine-crashed", timeout=10)
    reported = time.monotonic()
    assert reported - killed.at < 2.0
    assert "SIGKILL" in crash.message and not crash.recoverable
    client.on_event = original
    mark = log.mark()
    client.restart(reload=True)
    assert isinstance(log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)), start=mark), p.ModelLoaded)
    client.send(p.Generate("after", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=4)))
    assert len(done_for(log, "after", mark).token_ids) == 4


def test_kernel_switches_apply_live_and_survive_a_restart(endless_checkpoint, kernels):
    # `kernels`: built here first, so the worker's bf16 load (native kernels by default) finds them cached
    client, log = started_client()
    try:
        client.send(p.LoadModel(path=str(endless_checkpoint), budget="all", store="ram", dtype="bfloat16"))
        loaded = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
        assert isinstance(loaded, p.ModelLoaded) and loaded.fast_decode and loaded.fast_decode_available  # the default
        mark = log.mark()
        client.send(p.SetFastDecode(False))  # the System panel's Exact switch
        changed = log.wait_for(lambda e: isinstance(e, p.FastDecodeChanged), start=mark)
        assert not changed.enabled and changed.available
        client.send(p.Generate("f", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=8)))
        assert len(done_for(log, "f", mark).token_ids) == 8
        mark = log.mark()
        client.send(p.SetInt8Inputs(True))  # the System panel's lossy 8-bit prompt switch: live too
        assert log.wait_for(lambda e: isinstance(e, p.FastDecodeChanged), start=mark).int8_inputs
        mark = log.mark()
        client.restart(reload=True)  # e.g. after a crash: both switches stay as the user left them
        kept = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)), start=mark)
        assert isinstance(kept, p.ModelLoaded) and kept.int8_inputs and not kept.fast_decode
        mark = log.mark()
        client.send(p.LoadModel(path=str(endless_checkpoint), budget="all", store="ram"))  # float32: exact kernels only
        plain = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)), start=mark)
        assert isinstance(plain, p.ModelLoaded) and not plain.fast_decode_available and not plain.fast_decode
    finally:
        client.stop()


def test_corrupt_checkpoint_is_an_error_and_the_worker_stays(tmp_path, endless_checkpoint):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(endless_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    client, log = started_client()
    try:
        client.send(p.LoadModel(path=str(broken)))
        error = log.wait_for(lambda e: isinstance(e, p.Error))
        assert error.kind == "bad-checkpoint" and "model.safetensors" in error.message and error.recoverable
        assert client.alive
        mark = log.mark()
        client.send(p.LoadModel(path=str(endless_checkpoint)))
        assert isinstance(log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)), start=mark), p.ModelLoaded)
    finally:
        client.stop()


def test_telemetry_agrees_with_the_engine_counts(engine):
    client, log = engine
    mark = log.mark()
    client.send(p.Generate("t", prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0, max_new_tokens=12)))
    done = done_for(log, "t", mark)
    final = [e for e in log.events[mark:] if isinstance(e, p.TelemetrySnapshot)][-1]
    loaded = log.of(p.ModelLoaded)[0]
    activation = final.activation_request.numpy()
    assert activation.shape == (loaded.num_layers, loaded.num_experts)
    forwarded = len(PROMPT_IDS) + len(done.token_ids) - 1  # the last token is sampled, never fed back
    assert (activation.sum(axis=1) == forwarded * loaded.top_k).all()
    assert final.hit_rate_request == pytest.approx(done.stats.hit_rate)
    assert final.tokens_generated == len(done.token_ids)
    assert final.resident.numpy().sum(axis=1).tolist() == final.slots_per_layer
    assert final.link == "disk -> RAM" and final.rss_bytes > 0
    snapshots = [e for e in log.events[mark:] if isinstance(e, p.TelemetrySnapshot)]
    assert len(snapshots) <= 2 + 12  # a few per reply, never one per expert
    # the reply's first snapshot says it started (a client waiting for "idle" took it for the end)
    assert snapshots[0].request_id == "t" and snapshots[0].state == "prefill", snapshots[0].state


def test_gui_side_imports_pull_in_neither_torch_nor_qt():
    code = ("import sys, engine.protocol, engine.process.client; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'PySide', 'PyQt', 'transformers'))]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_the_window_s_chat_joins_ahead_of_waiting_api_requests(one_at_a_time_engine):
    client, log = one_at_a_time_engine
    assert log.of(p.ModelLoaded)[0].parallel == 1
    mark = log.mark()
    first, waiting = f"{p.API_REQUEST_PREFIX}first", f"{p.API_REQUEST_PREFIX}waiting"
    for rid, tokens in ((first, 200), (waiting, 30), ("chat-1", 30)):
        client.send(p.Generate(rid, prompt_ids=PROMPT_IDS, sampling=p.SamplingSettings(temperature=0,
                                                                                         max_new_tokens=tokens)))
    for rid in (first, waiting, "chat-1"):
        done_for(log, rid, mark)
    events = log.events[mark:]

    def at(kind, rid: str) -> int:
        return next(i for i, e in enumerate(events) if isinstance(e, kind) and e.request_id == rid)

    # the chat opened beside the running API reply (one more than --parallel), before the waiting one
    assert at(p.PromptContext, "chat-1") < at(p.Done, first) < at(p.PromptContext, waiting)
    replies = {e.request_id: e.token_ids for e in events if isinstance(e, p.Done)}
    assert replies["chat-1"] == replies[waiting] == replies[first][:30]  # each the reply it gets alone
