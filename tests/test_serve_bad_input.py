"""Bad requests to `moescope serve`: each gets its status code and one clear message naming the
problem, and the server goes on serving."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.helpers.serve import ROOT, serve

pytestmark = pytest.mark.process

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server():
    process = serve("demo", "--api-key", KEY, "--max-body-kib", "16")
    yield process
    process.stop()


def post(server, path: str, body: dict | None = None, *, raw: bytes | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    url = (server.root if path.startswith("/api/") else server.url) + path  # Ollama's routes, or OpenAI's under /v1
    if raw is not None:
        return httpx.post(url, content=raw, headers={**headers, "Content-Type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict | str:
    """OpenAI's error object, or Ollama's message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message and "\n" not in message  # one line, for a person
    return error


def ask(text: str = "What is 4 plus 7?", **fields) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": text}], "temperature": 0, **fields}


def test_malformed_json(server):
    error = error_of(post(server, "/chat/completions", raw=b'{"model": "demo", "messages": ['), 400)
    assert "not valid JSON" in error["message"] and error["code"] == "invalid_json"


def test_unknown_model(server):
    error = error_of(post(server, "/chat/completions", ask(model="gpt-9")), 404)
    assert error["param"] == "model" and "'gpt-9'" in error["message"] and "'demo'" in error["message"]


def test_negative_max_tokens_names_the_field(server):
    error = error_of(post(server, "/chat/completions", ask(max_tokens=-5)), 400)
    assert error["param"] == "max_tokens" and error["message"].startswith("max_tokens:")


@pytest.mark.parametrize(("fields", "param"), [({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
                                               ({"messages": []}, "messages"), ({"stop": [1, 2]}, "stop"),
                                               ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role")])
def test_wrong_fields_are_named(server, fields, param):
    error = error_of(post(server, "/chat/completions", ask(**fields)), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}:")


def test_prompt_longer_than_the_context(server):
    error = error_of(post(server, "/completions", {"model": "demo", "prompt": "abc " * 200, "max_tokens": 4}), 400)
    assert error["code"] == "context_length_exceeded" and "512 tokens" in error["message"]


def test_body_over_the_limit(server):
    error = error_of(post(server, "/chat/completions", ask("x" * 20_000)), 413)
    assert "16 KiB" in error["message"]


@pytest.mark.parametrize("key", ["wrong", None])
def test_wrong_or_missing_api_key(server, key):
    for response in (post(server, "/chat/completions", ask(), key=key),
                     httpx.get(server.url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})):
        error = error_of(response, 401)
        assert error["code"] == "invalid_api_key" and "API key" in error["message"]


def test_ollamas_routes_need_the_key_and_answer_in_ollamas_shape(server):
    chat = {"model": "demo", "messages": [{"role": "user", "content": "What is 4 plus 7?"}], "stream": False,
            "options": {"temperature": 0}}
    for response in (post(server, "/api/chat", chat, key="wrong"),
                     httpx.get(server.root + "/api/tags", timeout=60)):
        assert response.status_code == 401 and "API key" in response.json()["error"]
    assert error_of(post(server, "/api/chat", {**chat, "messages": [{"role": "user", "content": "x" * 20_000}]}),
                    413) == "the request body is larger than the server's limit of 16 KiB"
    reply = post(server, "/api/chat", chat)
    assert reply.status_code == 200 and reply.json()["message"]["content"] == "11"


def test_anthropics_client_sends_the_key_its_own_way(server):
    import anthropic

    ask_it = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "What is 4 plus 7?"}],
              "extra_body": {"temperature": 0}}
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server.root, api_key="wrong", max_retries=0).messages.create(**ask_it)
    assert refused.value.body["error"]["type"] == "authentication_error"
    message = anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0).messages.create(**ask_it)
    assert message.content[0].text == "11"  # x-api-key: KEY


def test_the_server_keeps_serving_after_bad_requests(server):
    post(server, "/chat/completions", raw=b"{nope")
    post(server, "/chat/completions", ask(max_tokens=0))
    reply = post(server, "/chat/completions", ask())
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "11"


def test_other_addresses_need_an_api_key():
    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "serve", "--model", "demo", "--host", "0.0.0.0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "moescope: error: --host 0.0.0.0 would let other machines use the model: set --api-key KEY too "
        "(or keep the default 127.0.0.1)"]
