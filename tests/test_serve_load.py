"""`moescope serve` under load on loopback, bounded in count and time: concurrent clients, a full
queue, clients that go away, and an engine killed mid-stream.

Runs on the tiny Mixtral with no EOS (replies always run to max_tokens), so there is a reply to act on.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.helpers.checkpoints import save_endless_checkpoint
from tests.helpers.serve import serve

pytestmark = pytest.mark.process

CLIENTS, REQUESTS_EACH, QUEUE = 16, 4, 4
REQUEST_TIMEOUT_S = 120.0  # a request that takes longer has hung
MiB = 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_endless_checkpoint(tmp_path_factory.mktemp("serve-load") / "endless")
    process = serve(str(model), "--max-queue", str(QUEUE))
    process.model = str(model)
    yield process
    process.stop()


def body(server, max_tokens: int, stream: bool) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def one_request(server, stream: bool) -> tuple[int, dict]:
    """(status, what came back): the reply's text and finish reason, or the error and Retry-After."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, \
            http.stream("POST", server.url + "/chat/completions", json=body(server, 8, stream)) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, {"error": response.json()["error"], "retry": response.headers.get("retry-after")}
        if not stream:
            response.read()
            choice = response.json()["choices"][0]
            return 200, {"text": choice["message"]["content"], "finish": choice["finish_reason"]}
        text, finish = "", None
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
        return 200, {"text": text, "finish": finish}


def memory(server) -> dict[str, int]:
    return {"server": psutil.Process(server.process.pid).memory_info().rss,
            "engine": server.worker.memory_info().rss}


def test_concurrent_clients_are_answered_or_told_to_retry(server):
    def client(index: int) -> list[tuple[int, dict]]:
        return [one_request(server, stream=(index + i) % 2 == 0) for i in range(REQUESTS_EACH)]

    rounds, memories = [], [memory(server)]
    for _ in range(2):  # the second round shows whether memory keeps growing
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = [r for rs in pool.map(client, range(CLIENTS)) for r in rs]
        rounds.append(results)
        memories.append(memory(server))
    for results in rounds:
        assert len(results) == CLIENTS * REQUESTS_EACH  # every request came back (none hung past its timeout)
        answered = [r for status, r in results if status == 200]
        busy = [r for status, r in results if status == 429]
        assert len(answered) + len(busy) == len(results), {s for s, _ in results}
        assert answered and busy  # the queue bound was reached, and requests were still served
        assert {r["finish"] for r in answered} == {"length"} and len({r["text"] for r in answered}) == 1
        for r in busy:
            assert int(r["retry"]) >= 1 and r["error"]["code"] == "queue_full"
            assert f"{QUEUE} requests are already waiting or running" in r["error"]["message"]
    growth = {name: memories[2][name] - memories[1][name] for name in memories[0]}
    print(f"\nload: {[sum(s == 200 for s, _ in r) for r in rounds]} answered, "
          f"{[sum(s == 429 for s, _ in r) for r in rounds]} told 429, of {CLIENTS}x{REQUESTS_EACH} per round; "
          f"RSS MiB " + ", ".join(f"{n}: {memories[0][n] / MiB:.0f} -> {memories[1][n] / MiB:.0f} -> "
                                  f"{memories[2][n] / MiB:.0f}" for n in memories[0]))
    assert growth["server"] < 20 * MiB and growth["engine"] < 40 * MiB, growth


def telemetry_until(server, predicate, timeout: float = 60.0) -> dict:
    """The first telemetry snapshot (server-sent events) that satisfies `predicate`."""
    with httpx.stream("GET", server.root + "/moescope/v1/telemetry", timeout=timeout) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                snapshot = json.loads(line[6:])
                if predicate(snapshot):
                    return snapshot
    raise AssertionError("the telemetry stream ended")


def test_a_client_that_goes_away_cancels_its_generation(server):
    received, request_id = 0, None
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, \
            http.stream("POST", server.url + "/chat/completions", json=body(server, 400, True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                request_id = "api-" + chunk["id"].removeprefix("chatcmpl-")
                received += bool(chunk["choices"][0]["delta"].get("content"))
                if received == 5:
                    break  # leaving the block closes the connection mid-stream
    idle = telemetry_until(server, lambda s: s["request_id"] == request_id and s["state"] == "idle")
    print(f"\ndisconnect: the client read {received} tokens of 400; the engine stopped after {idle['tokens_generated']}")
    # stopped between two tokens: no further than the tokens already on their way to the client
    assert received <= idle["tokens_generated"] < received + 16, idle["tokens_generated"]
    status, reply = one_request(server, stream=False)
    assert status == 200 and reply["finish"] == "length"


def test_an_engine_killed_mid_stream_ends_that_stream_with_an_error_and_the_next_request_succeeds(server):
    mark = server.mark()
    events: list[dict] = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, \
            http.stream("POST", server.url + "/chat/completions", json=body(server, 400, True)) as response:
        killed = False
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3 and not killed:
                    os.kill(server.worker.pid, signal.SIGKILL)
                    killed = True
    assert killed and "error" in events[-1], events[-1]
    error = events[-1]["error"]
    assert error["code"] == "engine_crashed" and "SIGKILL" in error["message"]
    server.wait_for("restarting", start=mark)
    status, reply = one_request(server, stream=False)  # waits for the reloaded model, then is served
    assert status == 200 and reply["finish"] == "length"
