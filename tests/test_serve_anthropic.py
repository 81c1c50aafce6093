"""`moescope serve` on the demo model, used through the official `anthropic` client: Anthropic's Messages
API (`/v1/messages`) gives the replies the OpenAI routes give, whole and streamed, with its stop
reasons, usage and error shapes."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.helpers.serve import served

pytestmark = pytest.mark.process

SPELL = "Spell 'elephant'."
GREEDY = {"temperature": 0}  # the client has no sampling arguments; the API still takes them

server = served("demo")


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key="not-needed-here", timeout=120, max_retries=0)


def ask(text: str = SPELL) -> list[dict]:
    return [{"role": "user", "content": text}]


def openai_chat(server, text: str = SPELL, **fields) -> dict:
    body = {"model": "demo", "messages": ask(text), "temperature": 0, **fields}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=120).json()


def test_a_message_equals_the_openai_route(server, client):
    message = client.messages.create(model="demo", max_tokens=64, messages=ask(), extra_body=GREEDY)
    expected = openai_chat(server, max_tokens=64)
    assert message.type == "message" and message.role == "assistant" and message.model == "demo"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"] == "e-l-e-p-h-a-n-t"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert message.id.startswith("msg_")


def test_system_blocks_max_tokens_and_stop_sequences(server, client):
    system = [{"type": "text", "text": "You are terse."}]
    short = client.messages.create(model="demo", max_tokens=3, messages=ask(), extra_body=GREEDY, system=system)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    whole = client.messages.create(model="demo", max_tokens=64, messages=ask(), extra_body=GREEDY, system=system)
    assert whole.content[0].text.startswith(short.content[0].text)
    cut = client.messages.create(model="demo", max_tokens=64, messages=ask(), extra_body=GREEDY, stop_sequences=["p"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "p"
    assert cut.content[0].text == "e-l-e-"


def test_the_stream_gives_the_whole_message_event_by_event(client):
    whole = client.messages.create(model="demo", max_tokens=64, messages=ask(), extra_body=GREEDY)
    with client.messages.stream(model="demo", max_tokens=64, messages=ask(), extra_body=GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("text") > 3  # token by token
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_bad_requests_get_anthropics_error_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="demo", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"] == {"type": "invalid_request_error", "message":
                                           "messages[0].content[0]: MoEScope does not support 'image' content blocks"}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-opus", max_tokens=8, messages=ask())
    assert "this server serves 'demo'" in unknown.value.body["error"]["message"]
    missing = httpx.post(server.root + "/v1/messages", json={"model": "demo", "messages": ask()}, timeout=60)
    assert missing.status_code == 400
    assert missing.json()["error"] == {"type": "invalid_request_error", "message": "max_tokens: is required"}
