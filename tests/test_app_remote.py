"""The window with a remote engine (a stand-in in vLLM's and SGLang's shapes, and a real `moescope serve`),
and the window's own "Local server" used by the official openai client. Offscreen, waits on state."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import ollama
import openai
import pytest

from app.connect_dialog import ConnectDialog
from app.engine_bridge import EngineBridge
from engine import protocol as p
from tests.helpers.checkpoints import save_endless_checkpoint
from tests.helpers.openai_standin import LAYERS, REPLY, StandIn
from tests.helpers.remote_window import LOAD_MS, REPLY_MS, connected, say, window_for
from tests.helpers.serve import serve


def test_a_vllm_server_chats_and_its_routing_fills_the_heatmap(qtbot, tmp_path):
    with StandIn("vllm") as standin:
        window, events = window_for(qtbot, tmp_path)
        connected(qtbot, window, standin.url)
        assert window.model_bar.name.text() == "standin/moe-model" and "remote engine" in window.model_bar.details.text()
        done = say(qtbot, window, events, "Hi")
        reply = window.chat_view.widgets()[-1]
        assert reply.text == done.text == "".join(REPLY)
        stats = reply.stats.text()
        assert "decode" in stats and "TTFT" in stats and "hit rate" not in stats  # no cache of ours to hit

        qtbot.waitUntil(lambda: window.heatmap.data is not None and window.heatmap.data.counts.sum() > 0, timeout=5000)
        counts = window.heatmap.data.counts
        assert counts.shape == (LAYERS, LAYERS + 1) and counts[1, 1] == counts[1, 2] == len(REPLY) - 1
        assert "routed_experts" in window.heatmap.scale_label.text()
        for panel in (window.hit_rate, window.traffic, window.budget, window.system):
            assert panel.remote_notice.isVisible() and "does not apply to a remote engine" in panel.remote_notice.text()

        window.chat.regenerate(window.chat_view.widgets()[-1].message_id)  # regenerate works as with a local model
        qtbot.waitUntil(lambda: len(events.done()) == 2, timeout=REPLY_MS)
        stored = window.store.messages(window.chat.conversation.id)
        assert [(m.role, m.content) for m in stored] == [("user", "Hi"), ("assistant", "".join(REPLY))]
        assert standin.requests[-1]["messages"] == [{"role": "user", "content": "Hi"}]
        qtbot.waitUntil(lambda: window.heatmap.data.counts[1, 1] == len(REPLY) - 1, timeout=5000)
        window.heatmap.mode.setCurrentIndex(1)  # since connecting: both replies
        qtbot.waitUntil(lambda: window.heatmap.data.counts[1, 1] == 2 * (len(REPLY) - 1), timeout=5000)


def test_an_sglang_record_fills_the_heatmap(qtbot, tmp_path):
    with StandIn("sglang") as standin:
        window, events = window_for(qtbot, tmp_path)
        connected(qtbot, window, standin.url)
        assert "No routing from this server yet" in window.heatmap.scale_label.text()
        say(qtbot, window, events, "Hi")
        qtbot.waitUntil(lambda: window.heatmap.data is not None, timeout=5000)
        assert np.array_equal(window.heatmap.data.counts[0, :2], [len(REPLY) - 1] * 2)
        assert "SGLang" in window.heatmap.scale_label.text()


def test_the_connect_dialog_lists_the_servers_models(qtbot):
    with StandIn("vllm") as standin:
        dialog = ConnectDialog(url=standin.url.removesuffix("/v1"))
        qtbot.addWidget(dialog)
        dialog.list_models()
        qtbot.waitUntil(lambda: dialog.model.count() == 1, timeout=10_000)
        assert dialog.values() == (standin.url.removesuffix("/v1"), None, "standin/moe-model")
    dialog.url.setText("http://127.0.0.1:9")
    dialog.list_models()
    qtbot.waitUntil(lambda: dialog.list_button.isEnabled(), timeout=10_000)
    assert dialog.status.text().startswith("cannot reach http://127.0.0.1:9/v1")


@pytest.mark.process
def test_stop_works_against_moescope_serve_as_a_remote_engine(qtbot, tmp_path):
    server = serve(str(save_endless_checkpoint(tmp_path / "endless")))
    try:
        window, events = window_for(qtbot, tmp_path)
        connected(qtbot, window, server.url)
        window.chat_view.settings.max_tokens.setValue(400)
        window.chat_view.composer.send_requested.emit("Hello there")
        qtbot.waitUntil(lambda: len(events.of(p.Token)) >= 3, timeout=REPLY_MS)
        window.chat.stop()
        qtbot.waitUntil(lambda: bool(events.done()), timeout=REPLY_MS)
        assert events.done()[-1].finish_reason == "cancelled" and not window.chat.streaming
        assert window.chat_view.widgets()[-1].text == events.done()[-1].text != ""
    finally:
        server.stop()


@pytest.mark.process
def test_the_local_server_serves_the_windows_engine(qtbot, tmp_path):
    window, events = window_for(qtbot, tmp_path, EngineBridge())
    window.start_engine("demo", "all")
    qtbot.waitUntil(lambda: window.chat.ready or window.banner.isVisible(), timeout=LOAD_MS)
    assert window.chat.ready, window.banner.label.text()
    panel = window.server_panel
    assert not panel.switch.isChecked() and not window.server.running  # off until the user turns it on
    panel.port.setValue(0)
    panel.switch.setChecked(True)
    url = panel.url.text()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")

    changes: list[int] = []  # the dock's queue line follows these
    window.server.queue_changed.connect(changes.append)
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0)
    reply: list = []
    # the request blocks, so it runs on a thread: the engine's events reach the server through the GUI thread
    worker = threading.Thread(target=lambda: reply.append(client.chat.completions.create(
        model="demo", temperature=0, messages=[{"role": "user", "content": "Spell 'cat'."}])))
    worker.start()
    qtbot.waitUntil(lambda: bool(reply), timeout=REPLY_MS)
    worker.join()
    assert reply[0].choices[0].message.content == "c-a-t"
    qtbot.waitUntil(lambda: "/v1/chat/completions 200" in panel.log.toPlainText(), timeout=5000)
    api_snapshots = [e for e in events.of(p.TelemetrySnapshot) if p.is_api_request(e.request_id)]
    assert api_snapshots  # the panels saw the API's request live, like a chat reply
    assert window.chat_view.widgets() == [] and not window.banner.isVisible()  # the chat is untouched
    qtbot.waitUntil(lambda: changes[-1:] == [0], timeout=5000)
    assert 1 in changes  # the request was counted while it ran
    assert panel.queue.text().startswith("Requests: idle.") and "up to 16 may be in" in panel.queue.text()

    root = url.removesuffix("/v1")
    assert root in panel.status.text()  # where an Ollama client points
    answer = []
    worker = threading.Thread(target=lambda: answer.append(ollama.Client(host=root, timeout=120).chat(
        model="demo", messages=[{"role": "user", "content": "Spell 'cat'."}], options={"temperature": 0})))
    worker.start()
    qtbot.waitUntil(lambda: bool(answer), timeout=REPLY_MS)
    worker.join()
    assert answer[0].message.content == "c-a-t"
    qtbot.waitUntil(lambda: "/api/chat 200" in panel.log.toPlainText(), timeout=5000)

    panel.switch.setChecked(False)
    assert panel.url.text() == "" and not window.server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)
