"""`moescope serve --parallel 3`: concurrent requests decode together (their tokens interleave, each the
reply it gets alone), and an engine killed mid-batch ends every open stream with an error, then serves
again. On the tiny Mixtral with no EOS, so every reply runs to max_tokens."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.checkpoints import save_endless_checkpoint
from tests.helpers.serve import serve

pytestmark = pytest.mark.process

REQUEST_TIMEOUT_S = 120.0
PROMPTS = ["Hello there", "What is a cat?", "Spell dog"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_endless_checkpoint(tmp_path_factory.mktemp("serve-batch") / "endless")
    process = serve(str(model), "--parallel", "3")
    process.model = str(model)
    yield process
    process.stop()


class Arrivals:
    """Every streamed chunk of every request, stamped in the order they arrived across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order = itertools.count()
        self.chunks: dict[int, list[tuple[int, dict]]] = {}

    def add(self, index: int, chunk: dict) -> int:
        with self._lock:
            stamp = next(self._order)
            self.chunks.setdefault(index, []).append((stamp, chunk))
            return sum(bool(content(c)) for _, c in self.chunks[index])


def stream_chat(server, index: int, max_tokens: int, arrivals: Arrivals, on_chunk=None) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[index]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, \
            http.stream("POST", server.url + "/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens = arrivals.add(index, json.loads(line[6:]))
                if on_chunk is not None:
                    on_chunk(index, tokens)


def content(chunk: dict) -> str:
    return chunk["choices"][0]["delta"].get("content") or "" if chunk.get("choices") else ""


def text_of(chunks: list[tuple[int, dict]]) -> str:
    return "".join(content(chunk) for _, chunk in chunks)


def reply_alone(server, index: int, max_tokens: int) -> str:
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[index]}],
            "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(server.url + "/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    return response.json()["choices"][0]["message"]["content"]


def test_three_streams_decode_together_each_with_the_reply_it_gets_alone(server):
    lengths = [24, 12, 18]
    alone = [reply_alone(server, i, n) for i, n in enumerate(lengths)]
    arrivals = Arrivals()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: stream_chat(server, i, lengths[i], arrivals), range(3)))
    for index in range(3):
        assert text_of(arrivals.chunks[index]) == alone[index]
    with_text = [[stamp for stamp, chunk in chunks if content(chunk)] for chunks in arrivals.chunks.values()]
    # every stream had its first token before any had its last: not served one after another
    assert max(stamps[0] for stamps in with_text) < min(stamps[-1] for stamps in with_text)


def test_an_engine_killed_mid_batch_ends_every_stream_with_an_error_and_serves_again(server):
    mark = server.mark()
    arrivals, killed = Arrivals(), threading.Event()
    started: set[int] = set()
    lock = threading.Lock()

    def kill_when_all_stream(index: int, tokens: int) -> None:
        with lock:
            if tokens >= 2:
                started.add(index)
            if len(started) == 3 and not killed.is_set():
                killed.set()
                os.kill(server.worker.pid, signal.SIGKILL)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: stream_chat(server, i, 400, arrivals, kill_when_all_stream), range(3)))
    assert killed.is_set()
    for index in range(3):
        last = arrivals.chunks[index][-1][1]
        assert last["error"]["code"] == "engine_crashed" and "SIGKILL" in last["error"]["message"], last
    server.wait_for("restarting", start=mark)
    assert len(reply_alone(server, 0, 6)) > 0  # waits for the reloaded model, then is served


def test_the_telemetry_stream_carries_the_batch_as_json():
    from dataclasses import replace

    from engine import protocol as p
    from engine.serve.app import snapshot_json
    from tests.helpers.app_fixtures import snapshot

    together = replace(snapshot(), streams=[p.StreamInfo("api-1", "decoding", 12, 4, 9.5)],
                       sharing=p.BatchSharing(streams=2, turns=3, uses=48, distinct=30, layers=4))
    data = json.loads(json.dumps(snapshot_json(together)))
    assert data["streams"] == [{"request_id": "api-1", "state": "decoding", "prompt_tokens": 12, "tokens": 4,
                                "decode_tokens_per_s": 9.5}]
    assert data["sharing"] == {"streams": 2, "turns": 3, "uses": 48, "distinct": 30, "layers": 4}
    assert json.loads(json.dumps(snapshot_json(snapshot())))["sharing"] is None
