"""Remote engines: `RemoteClient` (the local client's interface over the OpenAI API) against a real
`moescope serve`, and against a stand-in answering in vLLM's and SGLang's routing shapes."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from engine import protocol as p
from engine.remote.client import RemoteClient, RemoteTarget
from engine.remote.routing import decode_routed_experts
from tests.helpers.engine_events import EventLog
from tests.helpers.openai_standin import LAYERS, REPLY, StandIn
from tests.helpers.serve import serve

KEY = "remote-key"


def connect(url: str, key: str | None = None, model: str = "") -> tuple[RemoteClient, EventLog]:
    log = EventLog()
    client = RemoteClient(log, RemoteTarget(url, key, model))
    client.start()
    return client, log


def ask(client: RemoteClient, log: EventLog, text: str, **sampling) -> p.Done:
    mark = log.mark()
    client.send(p.Generate("r1", messages=[{"role": "user", "content": text}],
                           sampling=p.SamplingSettings(**{"temperature": 0, **sampling})))
    return log.wait_for(lambda e: isinstance(e, (p.Done, p.Error)) and e.request_id == "r1", 120, mark)


@pytest.mark.process
def test_chat_with_moescope_serve_as_a_remote_engine():
    server = serve("demo", "--api-key", KEY)
    try:
        client, log = connect(server.url, KEY)
        loaded = log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
        assert isinstance(loaded, p.ModelLoaded) and loaded.remote == server.url and loaded.name == "demo"
        assert loaded.context_length == 512
        done = ask(client, log, "Spell 'elephant'.")
        assert isinstance(done, p.Done) and done.text == "e-l-e-p-h-a-n-t" and done.finish_reason == "stop"
        streamed = "".join(e.text for e in log.of(p.Token) if e.request_id == "r1")
        assert streamed == done.text and len(log.of(p.Token)) > 3
        assert done.stats.prefill_tokens > 0 and done.stats.decode_tokens == 16 and done.stats.ttft_s > 0
        routing = log.of(p.RoutingSnapshot)[-1]  # our server's routed_experts, read like vLLM's
        counts = routing.activation_request.numpy()
        assert counts.shape[0] == 4 and counts.shape[1] <= 8 and counts.sum() == 15 * 4 * 2
        client.stop()

        _, refused = connect(server.url, "wrong")
        error = refused.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error)))
        assert isinstance(error, p.Error) and "refused the API key (401)" in error.message
    finally:
        server.stop()


def test_vllm_routed_experts_feed_the_routing_counts():
    with StandIn("vllm") as standin:
        client, log = connect(standin.url)
        assert isinstance(log.wait_for(lambda e: isinstance(e, (p.ModelLoaded, p.Error))), p.ModelLoaded)
        done = ask(client, log, "Hi")
        assert done.text == "".join(REPLY) and done.stats.decode_tokens == len(REPLY)
        routing = log.of(p.RoutingSnapshot)[-1]
        counts = routing.activation_request.numpy()
        expected = np.zeros((LAYERS, LAYERS + 1), dtype=np.int32)
        for layer in range(LAYERS):
            expected[layer, [layer, layer + 1]] = len(REPLY) - 1
        assert np.array_equal(counts, expected) and "routed_experts" in routing.source
        ask(client, log, "Again")
        assert np.array_equal(log.of(p.RoutingSnapshot)[-1].activation_total.numpy(), 2 * expected)
        assert standin.requests[-1]["stream"] and standin.requests[-1]["model"] == "standin/moe-model"
        client.stop()


def test_sglang_expert_distribution_record_feeds_the_routing_counts():
    with StandIn("sglang") as standin:
        client, log = connect(standin.url)
        log.wait_for(lambda e: isinstance(e, p.ModelLoaded))
        assert client.sglang_record
        ask(client, log, "Hi")
        routing = log.wait_for(lambda e: isinstance(e, p.RoutingSnapshot))
        counts = routing.activation_request.numpy()
        assert "SGLang" in routing.source and counts[0, 0] == counts[0, 1] == len(REPLY) - 1 and counts.sum() == 30
        client.stop()


def test_a_server_without_routing_still_chats_and_a_wrong_model_is_named():
    with StandIn("plain") as standin:
        client, log = connect(standin.url)
        log.wait_for(lambda e: isinstance(e, p.ModelLoaded))
        assert ask(client, log, "Hi", max_new_tokens=3).finish_reason == "length"
        assert not log.of(p.RoutingSnapshot)
        client.stop()
        _, wrong = connect(standin.url, model="other/model")
        error = wrong.wait_for(lambda e: isinstance(e, p.Error))
        assert error.message.endswith("does not serve 'other/model'; it serves standin/moe-model")


def test_an_unreachable_server_is_one_clear_line():
    _, log = connect("http://127.0.0.1:9")  # the discard port: nothing listens there
    error = log.wait_for(lambda e: isinstance(e, p.Error))
    assert error.kind == "remote-unreachable" and error.message.startswith("cannot reach http://127.0.0.1:9/v1")
    assert "\n" not in error.message


def test_routed_experts_in_each_form_a_server_may_send():
    routed = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    buffer = io.BytesIO()
    np.save(buffer, routed)
    forms = [routed.tolist(), base64.b64encode(buffer.getvalue()).decode(),
             {"encoding": "base64", "dtype": "int16", "shape": [2, 3, 4], "data": base64.b64encode(routed.tobytes()).decode()}]
    for form in forms:
        assert np.array_equal(decode_routed_experts(form), routed)
    assert decode_routed_experts(base64.b64encode(routed.tobytes()).decode()) is None  # no shape: cannot be read
    assert decode_routed_experts(None) is None and decode_routed_experts([1, 2]) is None
