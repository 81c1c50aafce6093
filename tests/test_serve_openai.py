"""`moescope serve` on the demo model, used through the official `openai` client: what an editor or a
script sees. The replies must equal `moescope generate` with the same settings."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.serve import cli_generate, serve

pytestmark = pytest.mark.process

QUESTION = "What is 4 plus 7?"
SPELL = "Spell 'elephant'."


@pytest.fixture(scope="module")
def server():
    process = serve("demo")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def chat(client: openai.OpenAI, text: str, **kwargs):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": text}], **kwargs)


def streamed(client: openai.OpenAI, text: str, **kwargs) -> tuple[str, list]:
    chunks = list(chat(client, text, stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_lists_the_loaded_model(client):
    assert [m.id for m in client.models.list()] == ["demo"]


def test_chat_streamed_and_not_equals_moescope_generate(client):
    expected = cli_generate("demo", SPELL)  # greedy, chat template, as the API with temperature 0
    reply = chat(client, SPELL, temperature=0)
    assert reply.choices[0].message.content == expected["text"] == "e-l-e-p-h-a-n-t"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(expected["token_ids"])  # the EOS counts, as vLLM counts it
    assert reply.usage.prompt_tokens == expected["stats"]["prefill_tokens"]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    text, chunks = streamed(client, SPELL, temperature=0, stream_options={"include_usage": True})
    assert text == expected["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # streamed token by token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_equal_generate_raw(client):
    prompt = "<|im_start|>user\nReverse the word 'apple'.<|im_end|>\n<|im_start|>assistant\n"
    expected = cli_generate("demo", prompt, "--raw", "--max-new-tokens", "12")
    reply = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected["text"]
    assert reply.usage.completion_tokens == len(expected["token_ids"]) <= 12
    stream = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected["text"]


def test_max_tokens_cuts_the_reply(client):
    reply = chat(client, SPELL, temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    assert reply.choices[0].message.content == "e-l"


def test_stop_strings_end_the_reply_before_them(client):
    reply = chat(client, SPELL, temperature=0, stop="p")
    assert reply.choices[0].message.content == "e-l-e-" and reply.choices[0].finish_reason == "stop"
    text, _ = streamed(client, SPELL, temperature=0, stop=["h", "p"])
    assert text == "e-l-e-"


def test_a_seed_reproduces_a_sampled_reply_and_equals_generate(client):
    settings = {"temperature": 2.0, "top_p": 1.0, "seed": 1234, "max_tokens": 16}

    def sample(**overrides) -> str:
        return client.completions.create(model="demo", prompt="The", **{**settings, **overrides}).choices[0].text

    first = sample()
    assert sample() == first
    expected = cli_generate("demo", "The", "--raw", "--temperature", "2", "--top-p", "1", "--seed", "1234",
                            "--max-new-tokens", "16")
    assert first == expected["text"]
    assert {sample(seed=seed) for seed in (1, 2, 3)} - {first}, "other seeds sample other replies"


def test_routed_experts_in_vllms_shape(client):
    reply = chat(client, SPELL, temperature=0, extra_body={"return_routed_experts": True})
    routed = reply.choices[0].model_extra["routed_experts"]  # [tokens, layers, top_k]
    assert len(routed) == reply.usage.completion_tokens - 1  # the last token is never fed back, as in vLLM
    assert {len(token) for token in routed} == {4} and {len(layer) for token in routed for layer in token} == {2}
    assert all(0 <= e < 8 for token in routed for layer in token for e in layer)
    plain = chat(client, SPELL, temperature=0)
    assert "routed_experts" not in (plain.choices[0].model_extra or {})
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_telemetry_stream_shows_what_the_panels_show(server, client):
    chat(client, SPELL, temperature=0)
    with httpx.stream("GET", f"{server.root}/moescope/v1/telemetry", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in response.iter_lines() if line.startswith("data: "))
    snapshot = json.loads(line.removeprefix("data: "))
    assert snapshot["request_id"].startswith("api-")  # the API's request, counted like a chat one
    assert len(snapshot["activation_request"]) == 4 and len(snapshot["activation_request"][0]) == 8
    assert sum(map(sum, snapshot["activation_request"])) > 0
    assert 0 <= snapshot["hit_rate_total"] <= 1 and snapshot["budget_bytes"] > 0
    assert {"bytes_per_s_ondemand", "slots_per_layer", "resident", "activation_total"} <= snapshot.keys()


def test_a_conversation_over_the_context_is_refused_not_trimmed(client):
    # An API client decides itself what to leave out: the server never drops turns (the window and
    # `moescope chat` do), it answers OpenAI's context_length_exceeded, streamed or not.
    pad = "Tell me more about the mixture of experts, please. " * 4
    messages = []
    for i in range(9):  # about three times the demo's 512-token context
        messages += [{"role": "user", "content": f"{i}: {pad}"}, {"role": "assistant", "content": "Sure."}]
    messages.append({"role": "user", "content": "Hello!"})
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="demo", messages=messages, max_tokens=4, stream=stream)
        assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
        assert refused.value.param == "messages" and "this model's context is 512 tokens" in refused.value.message
    with pytest.raises(openai.BadRequestError) as alone:  # one message too long alone says its length
        chat(client, pad * 3, max_tokens=4)
    assert alone.value.code == "context_length_exceeded"
    assert "this message is " in alone.value.message and "the model's context is 512 tokens" in alone.value.message
    assert chat(client, QUESTION, temperature=0).choices[0].message.content == "11"  # and it goes on serving
