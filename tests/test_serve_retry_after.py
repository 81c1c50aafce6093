"""Retry-After on a full queue: the median service time of the finished requests (from when the engine
took each up to its Done, the wait in the queue left out) times the requests ahead, rounded up.

The hub is driven through its own API: requests submitted, and the engine's events for them fed in at
known times of its clock (the engine's side of the protocol, no worker process: nothing here runs a model).
"""

from __future__ import annotations

import asyncio
import math
import statistics

import httpx

from engine import protocol as p
from engine.serve.app import create_app
from engine.serve.hub import DEFAULT_SERVICE_S, EngineHub, QueueFull, new_request_id
from tests.helpers.app_fixtures import model_loaded

SERVICE_S = [2.0, 3.5, 1.0, 8.0, 2.5, 0.75]  # median 2.25
QUEUE = len(SERVICE_S)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hub_on(clock: Clock, queue: int = QUEUE) -> tuple[EngineHub, list]:
    sent: list = []
    hub = EngineHub(sent.append, max_queue=queue, clock=clock)
    hub.on_event(model_loaded())
    return hub, sent


def generate() -> p.Generate:
    return p.Generate(new_request_id(), messages=[{"role": "user", "content": "Hello"}])


async def serve_in_turn(hub: EngineHub, clock: Clock, service_s: list[float]) -> None:
    """All submitted at once (so each but the first waits in the queue), then answered one after another,
    each taking its service time from its first event to its Done."""
    streams = [hub.submit(generate()) for _ in service_s]
    for stream, seconds in zip(streams, service_s, strict=True):
        hub.on_event(p.PromptContext(stream.request_id, 12, 256))
        clock.now += seconds / 2
        hub.on_event(p.Token(stream.request_id, "Hi", [7]))
        clock.now += seconds / 2
        hub.on_event(p.Done(stream.request_id, "eos", "Hi", [7, 2], p.ReplyStats()))
        assert isinstance(await stream.next(), p.Token)  # the context is not passed on: only the reply
        assert isinstance(await stream.next(), p.Done)
        stream.close()
    assert hub.busy == 0


def fill(hub: EngineHub) -> list:
    return [hub.submit(generate()) for _ in range(hub.max_queue)]


def queue_full(hub: EngineHub) -> int:
    try:
        hub.submit(generate())
    except QueueFull as exc:
        return exc.retry_after
    raise AssertionError("the queue took one more request than --max-queue")


def test_retry_after_is_the_median_service_time_times_the_requests_ahead():
    async def scenario() -> None:
        clock = Clock()
        hub, _ = hub_on(clock)
        await serve_in_turn(hub, clock, SERVICE_S)
        fill(hub)
        expected = math.ceil(statistics.median(SERVICE_S) * QUEUE)  # 2.25 s x 6 = 13.5 -> 14
        assert expected == 14
        assert hub.retry_after() == expected and queue_full(hub) == expected
        # the time each spent from its arrival, the queue wait included, would have said 63 s
        arrival_to_done = [sum(SERVICE_S[:i + 1]) for i in range(QUEUE)]
        assert statistics.median(arrival_to_done) * QUEUE == 63

    asyncio.run(scenario())


def test_a_default_until_a_request_has_finished_and_fewer_ahead_wait_less():
    async def scenario() -> None:
        clock = Clock()
        hub, _ = hub_on(clock, queue=3)
        assert hub.retry_after() == 1  # nothing ahead: at least 1 s
        streams = fill(hub)
        assert queue_full(hub) == math.ceil(DEFAULT_SERVICE_S * 3)
        streams[-1].close()  # a waiting client went away: two ahead now
        assert hub.retry_after() == math.ceil(DEFAULT_SERVICE_S * 2)

    asyncio.run(scenario())


def test_a_cancelled_reply_and_the_window_s_replies_do_not_count_but_hold_the_engine():
    async def scenario() -> None:
        clock = Clock()
        hub, _ = hub_on(clock, queue=2)
        first, second = hub.submit(generate()), hub.submit(generate())
        hub.on_event(p.PromptContext(first.request_id, 12, 256))
        clock.now += 0.5
        hub.on_event(p.Done(first.request_id, "cancelled", "", [], p.ReplyStats()))
        hub.on_event(p.PromptContext("chat-1", 12, 256))  # the window's chat, on the same engine
        clock.now += 30.0
        hub.on_event(p.Done("chat-1", "eos", "Hi", [7], p.ReplyStats()))
        clock.now += 0.1  # the worker tokenizes the next prompt: part of its service
        hub.on_event(p.PromptContext(second.request_id, 12, 256))
        clock.now += 3.9
        hub.on_event(p.Done(second.request_id, "eos", "Hi", [7], p.ReplyStats()))
        first.close()
        second.close()
        fill(hub)
        assert hub.retry_after() == 8  # 4.0 s (not 34, not 0.5) x 2

    asyncio.run(scenario())


def test_the_429_carries_retry_after_in_both_apis():
    async def scenario() -> None:
        clock = Clock()
        hub, _ = hub_on(clock, queue=2)
        await serve_in_turn(hub, clock, [3.0, 1.5])
        fill(hub)
        body = {"model": "tiny-test", "messages": [{"role": "user", "content": "Hello"}]}
        transport = httpx.ASGITransport(app=create_app(hub))
        async with httpx.AsyncClient(transport=transport, base_url="http://moescope") as http:
            openai, ollama = await http.post("/v1/chat/completions", json=body), await http.post("/api/chat", json=body)
        for response in (openai, ollama):
            assert response.status_code == 429 and response.headers["retry-after"] == "5"  # 2.25 s x 2, rounded up
        assert openai.json()["error"]["code"] == "queue_full" and "retry in 5 s" in openai.json()["error"]["message"]
        assert list(ollama.json()) == ["error"] and "retry in 5 s" in ollama.json()["error"]  # Ollama's shape

    asyncio.run(scenario())
