"""`moescope serve` on the demo model, used through the official `ollama` client: what a tool that
speaks only Ollama's API sees. The replies equal the OpenAI routes' (and so `moescope generate`'s)."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.helpers.serve import served

pytestmark = pytest.mark.process

SPELL = "Spell 'elephant'."
GREEDY = {"temperature": 0}


server = served("demo")


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.root, timeout=120)


def ask(text: str = SPELL) -> list[dict]:
    return [{"role": "user", "content": text}]


def openai_chat(server, **fields) -> dict:
    body = {"model": "demo", "messages": ask(), "temperature": 0, **fields}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=120).json()


def test_chat_equals_the_openai_route_with_ollamas_final_fields(server, client):
    reply = client.chat(model="demo", messages=ask(), options=GREEDY)
    expected = openai_chat(server)
    assert reply.message.role == "assistant"
    assert reply.message.content == expected["choices"][0]["message"]["content"] == "e-l-e-p-h-a-n-t"
    assert reply.model == "demo" and reply.done and reply.done_reason == "stop"
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert reply.eval_count == expected["usage"]["completion_tokens"]
    assert reply.prompt_eval_duration > 0 and reply.eval_duration > 0  # nanoseconds
    assert reply.prompt_eval_duration + reply.eval_duration <= reply.total_duration < 120 * 10**9
    assert reply.load_duration >= 0 and reply.created_at.endswith("Z")


def test_chat_streamed_concatenates_to_the_whole_reply(client):
    whole = client.chat(model="demo", messages=ask(), options=GREEDY)
    parts = list(client.chat(model="demo", messages=ask(), options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert len([part for part in parts if part.message.content]) > 3  # token by token
    assert not any(part.done for part in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "stop"
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count
    assert all(part.total_duration is None for part in parts[:-1])  # statistics on the final object only
    seeded = {"temperature": 1.5, "seed": 1234, "num_predict": 16}  # sampled, reproducibly
    sampled = client.chat(model="demo", messages=ask(), options=seeded).message.content
    assert "".join(part.message.content for part in client.chat(model="demo", messages=ask(), options=seeded,
                                                                   stream=True)) == sampled


def test_the_stream_is_ndjson(server):
    body = {"model": "demo", "messages": ask(), "options": GREEDY}  # no "stream": Ollama streams by default
    with httpx.stream("POST", server.root + "/api/chat", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines[-1]["done"] is True and {"total_duration", "eval_count"} <= lines[-1].keys()
    assert "".join(line["message"]["content"] for line in lines) == "e-l-e-p-h-a-n-t"


def test_generate_applies_the_chat_template_unless_raw(server, client):
    reply = client.generate(model="demo:latest", prompt=SPELL, options=GREEDY)
    assert reply.response == "e-l-e-p-h-a-n-t" and reply.done_reason == "stop" and reply.model == "demo:latest"
    prompt = "<|im_start|>user\nReverse the word 'apple'.<|im_end|>\n<|im_start|>assistant\n"
    raw = client.generate(model="demo", prompt=prompt, raw=True, options={**GREEDY, "num_predict": 12})
    completion = httpx.post(server.url + "/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 12,
                                                               "temperature": 0}, timeout=120).json()
    assert raw.response == completion["choices"][0]["text"]
    assert raw.eval_count == completion["usage"]["completion_tokens"] <= 12
    parts = list(client.generate(model="demo", prompt=SPELL, options=GREEDY, stream=True))
    assert "".join(part.response for part in parts) == reply.response and parts[-1].done


def test_options_num_predict_and_stop(client):
    short = client.chat(model="demo", messages=ask(), options={**GREEDY, "num_predict": 3})
    assert short.message.content == "e-l" and short.done_reason == "length" and short.eval_count == 3
    stopped = client.generate(model="demo", prompt=SPELL, options={**GREEDY, "stop": ["p"], "num_ctx": 4096})
    assert stopped.response == "e-l-e-" and stopped.done_reason == "stop"  # num_ctx is ignored


def test_an_empty_chat_or_prompt_only_loads_the_model(client):
    for reply in (client.chat(model="demo", messages=[]), client.generate(model="demo")):
        assert reply.done and reply.done_reason == "load"


def test_tags_ps_show_and_version_describe_the_loaded_model(server, client):
    [listed] = client.list().models
    assert listed.model == "demo:latest" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.family == "qwen3moe" and listed.details.format == "safetensors"
    [running] = client.ps().models
    assert running.model == "demo:latest" and running.context_length == 512 and running.size_vram == 0
    shown = client.show("demo")
    assert shown.capabilities == ["completion"] and shown.details.family == "qwen3moe"
    assert shown.modelinfo["qwen3moe.context_length"] == 512 and shown.modelinfo["qwen3moe.expert_count"] == 8
    assert httpx.get(server.root + "/api/version", timeout=30).json()["version"].count(".") == 2


@pytest.mark.parametrize("name", ["gpt-9", "demo:7b"])
def test_an_unknown_model_is_404_in_ollamas_shape(client, name):
    for call in (lambda: client.chat(model=name, messages=ask()),
                 lambda: list(client.chat(model=name, messages=ask(), stream=True)),
                 lambda: client.generate(model=name, prompt=SPELL), lambda: client.show(name)):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 404
        assert f"'{name}'" in refused.value.error and "'demo'" in refused.value.error


def test_a_malformed_body_is_400_naming_the_problem(server, client):
    response = httpx.post(server.root + "/api/chat", content=b'{"model": "demo", "messages": [',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]
    assert list(response.json()) == ["error"]  # Ollama's shape, not OpenAI's
    for call, field in ((lambda: client.chat(model="demo", messages=[{"role": "robot", "content": "hi"}]),
                         "messages[0].role"),
                        (lambda: client.chat(model="demo", messages=ask(), options={"num_predict": 0}),
                         "options.num_predict"),
                        (lambda: client.chat(model="demo", messages=ask(), format="json"), "format"),
                        (lambda: client.generate(model="demo", prompt=SPELL, suffix="end"), "suffix")):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400 and refused.value.error.startswith(f"{field}: "), refused.value.error
    assert client.chat(model="demo", messages=ask(), options=GREEDY).message.content == "e-l-e-p-h-a-n-t"


def test_a_prompt_over_the_context_is_400(client):
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="demo", prompt="abc " * 200, raw=True, options={"num_predict": 4})
    assert refused.value.status_code == 400 and "512 tokens" in refused.value.error
