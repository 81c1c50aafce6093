"""The model library dialog against a real engine worker, a local fake Hub and a tmp HF cache, offscreen.

Every wait ends on an event or a state (qtbot.waitUntil with a timeout), never on a sleep.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.engine_bridge import EngineBridge
from app.library_dialog import LibraryDialog
from app.main_window import MainWindow
from app.models.history import HistoryStore
from app.models.library import LibraryModel, default_format, fit_lines, format_lines, parse_request_id
from app.settings import AppSettings
from engine import protocol as p
from tests.helpers.app_fixtures import Recorder, ScriptedClient
from tests.helpers.hub.library_hub import HoldingHub, fill_hub, hub_environment, place_in_cache

GiB = 1024**3

ROOT = Path(__file__).resolve().parents[1]
START_MS = 180_000  # the worker imports torch before it answers: slow on a busy 2-core machine
ANSWER_MS = 60_000
CATALOG = [m["repo"] for m in json.loads((ROOT / "resources" / "catalog.json").read_text())["models"]]
CACHED = "someone/cached-mixtral"
MISSING = "nobody/no-such-model"
NOT_FOUND = (f"no model '{MISSING}' on the Hugging Face Hub (or it is private and you are not logged in); "
             "check the name, e.g. with `moescope models search mixtral`")
LEFT = Qt.MouseButton.LeftButton


@pytest.fixture
def hub(tmp_path, mixtral_checkpoint):
    with HoldingHub(lifetime_s=900) as server:
        server.ids = fill_hub(server, mixtral_checkpoint)  # type: ignore[attr-defined]
        server.cache = tmp_path / "hf-cache"  # type: ignore[attr-defined]
        server.cached = place_in_cache(server.cache, CACHED, mixtral_checkpoint)  # type: ignore[attr-defined]
        yield server


def open_library(qtbot, tmp_path: Path, hub) -> tuple[MainWindow, LibraryDialog, Recorder]:
    window = MainWindow(settings=AppSettings(str(tmp_path / "settings.ini")), store=HistoryStore(tmp_path / "h.sqlite3"))
    qtbot.addWidget(window)
    events = Recorder(window)
    window.show()
    with hub_environment(hub.url, hub.cache):
        window.bridge.start()  # no model yet: the library is where it comes from
    assert window.model_bar.library.isEnabled()
    qtbot.mouseClick(window.model_bar.library, LEFT)
    dialog = window.library
    assert dialog is not None and dialog.isVisible()
    qtbot.waitUntil(lambda: dialog.table.rowCount() > len(CATALOG), timeout=START_MS)
    return window, dialog, events


def rows(dialog: LibraryDialog) -> list[tuple[str, str]]:
    return [(dialog.table.item(r, 0).text(), dialog.table.item(r, 1).text()) for r in range(dialog.table.rowCount())]


def search(qtbot, dialog: LibraryDialog, text: str) -> None:
    dialog.search.setText(text)
    qtbot.keyClick(dialog.search, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: dialog.model.hub_query == text, timeout=ANSWER_MS)


def select(qtbot, dialog: LibraryDialog, repo_id: str) -> p.FitEstimateReady | None:
    """Select the row; wait for its estimate (or its error)."""
    assert dialog.select(repo_id)
    qtbot.waitUntil(lambda: dialog.model.estimate(repo_id) is not None
                    or repo_id.lower() in dialog.model.estimate_errors, timeout=ANSWER_MS)
    return dialog.model.estimate(repo_id)


def test_catalog_cache_search_fit_and_a_missing_repo(qtbot, tmp_path, hub):
    window, dialog, _ = open_library(qtbot, tmp_path, hub)
    listed = rows(dialog)
    assert [name for name, _ in listed] == [*CATALOG, CACHED]
    assert {status for _, status in listed[: len(CATALOG)]} == {"not downloaded"}
    assert listed[-1] == (CACHED, "downloaded")

    # typing filters the list at once, without the Hub
    dialog.search.setText("cached")
    assert rows(dialog) == [(CACHED, "downloaded")]

    est = select(qtbot, dialog, CACHED)
    assert est is not None and est.downloaded and est.budget == "all"
    assert dialog.verdict.text() == est.headline and est.headline.startswith("fits in RAM")
    assert dialog.numbers["Experts"].text().endswith("8 per layer x 3 MoE layers, top-2")
    assert dialog.numbers["Recommended budget"].text().startswith("all experts (")
    assert dialog.numbers["Download"].text() == "downloaded"
    assert dialog.use_button.isEnabled() and not dialog.download_button.isEnabled()

    # Enter searches the Hub: its results come after the matching local rows
    search(qtbot, dialog, "mixtral")
    names = [name for name, _ in rows(dialog)]
    assert names[-2:] == [hub.ids["tiny"], hub.ids["slow"]]
    assert names[:-2] == [*(r for r in CATALOG if "mixtral" in r.lower()), CACHED]
    assert dialog.status.text() == "2 Hub results for “mixtral”"

    est = select(qtbot, dialog, hub.ids["tiny"])
    assert est is not None and not est.downloaded and est.download_bytes > 0
    assert dialog.verdict.text() == est.headline
    assert dialog.download_button.isEnabled() and not dialog.use_button.isEnabled()

    # a repo that is not on the Hub: one clear line in the dialog, not a banner over the chat
    search(qtbot, dialog, MISSING)
    assert rows(dialog)[0][0] == MISSING
    assert select(qtbot, dialog, MISSING) is None
    assert dialog.status.text() == NOT_FOUND and dialog.verdict.text() == NOT_FOUND
    assert not dialog.download_button.isEnabled() and not dialog.use_button.isEnabled()
    assert not window.banner.isVisible() and window.chat.active is None


def test_download_progress_cancel_then_download_and_use(qtbot, tmp_path, hub):
    window, dialog, events = open_library(qtbot, tmp_path, hub)
    seen: list[tuple[bool, int, str]] = []  # the bar and its text after each progress event
    window.bridge.event.connect(lambda e: isinstance(e, p.DownloadProgress) and seen.append(
        (dialog.progress.isVisible(), dialog.progress.value(), dialog.progress_label.text())))

    # a download the Hub holds halfway: progress shows, Cancel stops it
    slow = hub.ids["slow"]
    search(qtbot, dialog, "slow")
    select(qtbot, dialog, slow)
    qtbot.mouseClick(dialog.download_button, LEFT)
    qtbot.waitUntil(lambda: hub.held.is_set() and dialog.model.download is not None
                    and dialog.model.download.bytes_total > 0, timeout=ANSWER_MS)
    assert dialog.progress.isVisible() and dialog.cancel_button.isEnabled() and not dialog.download_button.isEnabled()
    assert " of " in dialog.progress_label.text() and "/s" in dialog.progress_label.text()
    assert dict(rows(dialog))[slow].startswith("downloading")
    # What the dialog shows when the engine says "cancelling", read as that event lands: the
    # cancelled download may end a moment later, before a poll of the dialog would see it.
    cancelling: list[tuple[bool, str]] = []
    window.bridge.event.connect(lambda e: isinstance(e, p.DownloadProgress) and e.cancelling and cancelling.append(
        (dialog.cancel_button.isEnabled(), dialog.progress_label.text())))
    qtbot.mouseClick(dialog.cancel_button, LEFT)
    qtbot.waitUntil(lambda: bool(cancelling), timeout=ANSWER_MS)
    button_enabled, label = cancelling[0]
    assert not button_enabled and label.startswith("Cancelling")
    hub.release.set()
    qtbot.waitUntil(lambda: dialog.model.download is None, timeout=ANSWER_MS)
    assert dialog.status.text().startswith(f"download of '{slow}' cancelled: nothing was kept")
    assert not dialog.progress.isVisible() and dialog.download_button.isEnabled()
    assert dict(rows(dialog))[slow] == "not downloaded" and not window.banner.isVisible()

    # a whole download: the bar fills, the row says downloaded, Use loads it
    tiny = hub.ids["tiny"]
    search(qtbot, dialog, "tiny")
    select(qtbot, dialog, tiny)
    seen.clear()
    qtbot.mouseClick(dialog.download_button, LEFT)
    qtbot.waitUntil(lambda: dialog.use_button.isEnabled(), timeout=ANSWER_MS)
    [finished] = events.of(p.DownloadFinished)
    assert finished.repo_id == tiny and Path(finished.path).is_dir()
    assert any(visible and value == 1000 and " of " in text for visible, value, text in seen), seen
    assert dict(rows(dialog))[tiny] == "downloaded" and not dialog.progress.isVisible()
    assert dialog.status.text() == f"{tiny} downloaded: select it and press Use to load it"

    qtbot.mouseClick(dialog.use_button, LEFT)
    assert not dialog.isVisible()
    qtbot.waitUntil(lambda: bool(events.of(p.ModelLoaded)) or window.banner.isVisible(), timeout=START_MS)
    assert not window.banner.isVisible(), window.banner.label.text()
    loaded = events.of(p.ModelLoaded)[-1]
    assert window.bridge.last_load.path == finished.path and window.bridge.last_load.budget == "all"
    assert (loaded.num_layers, loaded.num_experts, loaded.top_k) == (3, 8, 2)
    qtbot.waitUntil(lambda: window.chat.ready, timeout=ANSWER_MS)


def test_model_keeps_state_from_events_alone():
    """The Qt-free model: rows, a download's life, and errors routed by their request id."""
    model = LibraryModel()
    model.apply(p.LibraryListing([p.LibraryEntry("a/one", "first"), p.LibraryEntry("b/two", "second", "cache", True, "/m")]))
    model.apply(p.LibraryListing([p.LibraryEntry("b/two", source="search"), p.LibraryEntry("c/three", source="search")],
                                 query="t"))
    assert [e.repo_id for e in model.rows()] == ["a/one", "b/two", "c/three"]  # no duplicate of a local row
    model.filter_text = "sec"
    assert [e.repo_id for e in model.rows()] == ["b/two", "c/three"]
    assert model.use_target("b/two") == ("/m", "", "original") and model.use_target("a/one") is None

    model.apply(p.DownloadProgress("a/one", 0, 0, 0.0, None, "looking up a/one…"))
    assert model.download.fraction is None and model.download.text == "looking up a/one…"
    assert not model.can_download("c/three")  # one at a time
    model.apply(p.DownloadProgress("a/one", 512 * 1024, 2 * 1024**2, 1024**2, 1.5, "x", 0, 2))
    assert model.status_text(model.entry("a/one")) == "downloading 25%"
    assert model.download.text == "512.00 KiB of 2.00 MiB at 1.00 MiB/s, 0:01 left · file 1 of 2"
    model.apply(p.DownloadProgress("a/one", 0, 0, 0.0, None, "cancelling…", cancelling=True))
    assert model.download.bytes_done == 512 * 1024 and model.download.cancelling
    model.apply(p.Error("cancelled", "download of 'a/one' cancelled", True, p.library_request_id("download", "a/one")))
    assert model.download is None and model.status == "download of 'a/one' cancelled" and not model.status_is_error

    model.apply(p.Error("repo-not-found", "no such", True, p.library_request_id("estimate", "c/three")))
    assert model.estimate_errors == {"c/three": "no such"} and not model.can_download("c/three")
    model.apply(p.Error("bad-budget", "a chat error", True, "r1"))  # not the library's
    assert model.status == "no such"
    assert parse_request_id("library:download:org/name") == ("download", "org/name")
    assert parse_request_id("library:list:") == ("list", "")


def test_dialog_sends_commands_and_forgets_the_work_of_a_stopped_engine(qtbot):
    """Widget level, with a scripted engine: which commands the dialog sends, and a restart mid-download."""
    bridge = EngineBridge(ScriptedClient)
    bridge.start()
    qtbot.waitUntil(lambda: bridge.pid == 4242, timeout=5000)
    dialog = LibraryDialog(bridge)
    qtbot.addWidget(dialog)
    dialog.show()
    client = bridge.client
    dialog.refresh()
    client.emit(p.LibraryListing([p.LibraryEntry("a/one", "first"), p.LibraryEntry("b/two", "second")]))
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 2, timeout=5000)
    assert dialog.select("a/one")
    assert client.of(p.EstimateModel) == [p.EstimateModel("a/one")]
    qtbot.mouseClick(dialog.download_button, LEFT)
    assert client.of(p.DownloadModel) == [p.DownloadModel("a/one")] and dialog.progress.isVisible()
    client.emit(p.DownloadProgress("a/one", 1024, 4096, 512.0, 6.0, "x", 0, 1))
    qtbot.waitUntil(lambda: dialog.progress.value() == 250, timeout=5000)
    qtbot.mouseClick(dialog.cancel_button, LEFT)
    assert client.of(p.CancelDownload) == [p.CancelDownload("a/one")]

    client.emit(p.EngineStarted(4343))  # restarted (say from the Engine menu): its download is gone
    qtbot.waitUntil(lambda: dialog.model.download is None, timeout=5000)
    assert not dialog.progress.isVisible() and dialog.download_button.isEnabled()
    assert client.of(p.ListLibrary) == [p.ListLibrary(), p.ListLibrary()]  # visible: listed again

    dialog.search.setText("three")
    qtbot.keyClick(dialog.search, Qt.Key.Key_Return)
    assert client.of(p.SearchLibrary) == [p.SearchLibrary("three")]
    client.emit(p.Error("network", "cannot reach the Hugging Face Hub", True, p.library_request_id("search")))
    qtbot.waitUntil(lambda: dialog.status.text() == "cannot reach the Hugging Face Hub", timeout=5000)
    assert dialog.model.searching is None


def test_the_fit_per_format_picks_what_use_loads():
    """Too big in bf16, offloaded at 8-bit, whole at 4-bit: "Use" loads the most precise format that runs, or
    the one picked, each with its own recommended budget."""
    model = LibraryModel()
    model.apply(p.LibraryListing([p.LibraryEntry("big/moe", "", "cache", True, "/big")]))
    fits = [p.FormatFit("original", "too-big", "too big", None, None, 60 * GiB, 6 * GiB),
            p.FormatFit("q8_0", "offload", "runs offloaded", "9.5GiB", int(9.5 * GiB), 32 * GiB, 3 * GiB),
            p.FormatFit("q4_k", "fits-ram", "fits in RAM", "all", 17 * GiB, 17 * GiB, GiB)]
    est = p.FitEstimateReady("big/moe", "too-big", "too big for this machine", None, None, 64 * GiB, 4 * GiB, 60 * GiB,
                             6 * GiB, 128, 48, 8, 30 * 10**9, 3 * 10**9, "bfloat16", 0, True, "/big", formats=fits,
                             format_summary="fits in RAM at 4-bit (21.00 GiB); too big in bf16")
    model.apply(est)
    assert default_format(est) == "q8_0"  # the most precise format that runs here
    assert model.use_target("big/moe") is None  # not in its original weights
    assert model.use_target("big/moe", "q8_0") == ("/big", "9.5GiB", "q8_0")
    assert model.use_target("big/moe", "q4_k") == ("/big", "all", "q4_k")
    assert format_lines(est) == ["Original: too big for this machine; experts 60.00 GiB",
                                 "8-bit (Q8_0), approximate: runs offloaded (budget 9.50 GiB); experts 32.00 GiB",
                                 "4-bit (Q4_K), approximate: fits in RAM; experts 17.00 GiB"]
    assert ("By format", "\n".join(format_lines(est))) in fit_lines(est)


def test_models_other_apps_have_show_source_quant_and_verdict_and_use_loads_the_file(qtbot, tmp_path):
    """LM Studio's and Ollama's entries as the engine lists them: each row says where the model is, its
    quant type and its verdict; Use hands the file's exact path to the load command, nothing copied."""
    from tests.helpers.remote_window import window_for

    window, _ = window_for(qtbot, tmp_path)
    window.bridge.start()
    client = window.bridge.client
    gguf = str(tmp_path / "lmstudio" / "pub" / "Qwen3-GGUF" / "Qwen3-Q4_K_M.gguf")
    blob = str(tmp_path / "ollama" / "blobs" / "sha256-ab12")
    odd = str(tmp_path / "lmstudio" / "pub" / "Odd-GGUF" / "odd.gguf")
    unmapped = "GGUF architecture 'grok' cannot be mapped to a model MoEScope runs"
    entries = [
        p.LibraryEntry(gguf, "downloaded by LM Studio", "lmstudio", True, gguf, 18 * GiB, title="pub/Qwen3-GGUF/Qwen3-Q4_K_M.gguf",
                       quant="Q4_K_M", fit_kind="offload", fit_headline="runs with experts offloaded to disk"),
        p.LibraryEntry(blob, "downloaded by Ollama", "ollama", True, blob, 17 * GiB, title="qwen3:30b", quant="Q4_K_M",
                       fit_kind="fits-ram", fit_headline="fits in RAM"),
        p.LibraryEntry(odd, "downloaded by LM Studio", "lmstudio", True, odd, GiB, title="pub/Odd-GGUF/odd.gguf",
                       quant="Q8_0", problem=unmapped, fit_kind="unsupported", fit_headline=f"cannot run yet: {unmapped}"),
    ]
    dialog = window.open_library()
    client.emit(p.LibraryListing(entries))
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 3, timeout=5000)
    shown = [[dialog.table.item(r, c).text() for c in range(6)] for r in range(3)]
    assert shown == [
        ["pub/Qwen3-GGUF/Qwen3-Q4_K_M.gguf", "downloaded", "18.00 GiB", "LM Studio", "Q4_K_M", "runs offloaded"],
        ["qwen3:30b", "downloaded", "17.00 GiB", "Ollama", "Q4_K_M", "fits in RAM"],
        ["pub/Odd-GGUF/odd.gguf", "downloaded, cannot run yet", "1.00 GiB", "LM Studio", "Q8_0", "cannot run yet"],
    ]
    assert dialog.table.item(2, 5).toolTip() == f"cannot run yet: {unmapped}"

    assert dialog.select(odd)
    assert dialog.verdict.text() == f"cannot run yet: {unmapped}" and not dialog.use_button.isEnabled()
    dialog.search.setText("qwen3:")  # the filter matches the name the app gives it
    assert dialog.table.rowCount() == 1 and dialog.table.item(0, 0).text() == "qwen3:30b"
    dialog.search.setText("")

    assert dialog.select(gguf)
    assert client.of(p.EstimateModel)[-1] == p.EstimateModel(gguf)  # the engine reads the file's header
    assert dialog.title.text() == "pub/Qwen3-GGUF/Qwen3-Q4_K_M.gguf" and dialog.use_button.isEnabled()
    qtbot.mouseClick(dialog.use_button, LEFT)
    [load] = client.of(p.LoadModel)
    assert load.path == gguf and load.expert_format == "original"


def test_a_gguf_repo_picks_a_quant_file_each_with_its_verdict(qtbot, tmp_path):
    """A GGUF repo from the Hub: the quant picker replaces the format picker; Download fetches the file picked,
    Use opens that file once it is downloaded."""
    from tests.helpers.remote_window import window_for

    window, _ = window_for(qtbot, tmp_path)
    window.bridge.start()
    client = window.bridge.client
    repo = "unsloth/Qwen3-30B-A3B-GGUF"
    dialog = window.open_library()
    client.emit(p.LibraryListing([p.LibraryEntry(repo, "qwen3_moe GGUF on the Hub: pick a quant file", "search",
                                                 quant="GGUF")], query="qwen3"))
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 1, timeout=5000)
    assert dialog.select(repo) and client.of(p.EstimateModel) == [p.EstimateModel(repo)]

    def estimate(q8_local: str | None) -> p.FitEstimateReady:
        quants = [p.QuantFit("Q4_K_M", ["Qwen3-30B-A3B-Q4_K_M.gguf"], 17 * GiB, "fits-ram", "fits in RAM", "all"),
                  p.QuantFit("Q8_0", ["Q8_0/a-00001-of-00002.gguf", "Q8_0/a-00002-of-00002.gguf"], 30 * GiB, "offload",
                             "runs with experts offloaded to disk", "12GiB", q8_local)]
        return p.FitEstimateReady(repo, "fits-ram", "fits in RAM", "all", 17 * GiB, 17 * GiB, GiB, 16 * GiB, GiB, 128,
                                  48, 8, 30 * 10**9, 3 * 10**9, "bfloat16", 17 * GiB, False, quants=quants,
                                  quant="Q4_K_M")

    client.emit(estimate(None))
    qtbot.waitUntil(lambda: dialog.quant_file.count() == 2, timeout=5000)
    assert [dialog.quant_file.itemText(i) for i in range(2)] == [
        "Q4_K_M · 17.00 GiB · fits in RAM", "Q8_0 · 30.00 GiB · runs offloaded"]
    assert dialog.quant_file.currentData() == "Q4_K_M" and dialog.quant_file.isVisibleTo(dialog)
    assert not dialog.expert_format.isVisibleTo(dialog)  # a GGUF is opened as it is, not converted
    assert dialog.download_button.isEnabled() and not dialog.use_button.isEnabled()

    dialog.quant_file.setCurrentIndex(1)
    dialog.quant_file.activated.emit(1)
    assert dialog.verdict.text() == "Q8_0: runs with experts offloaded to disk"
    qtbot.mouseClick(dialog.download_button, LEFT)
    assert client.of(p.DownloadModel) == [p.DownloadModel(repo, "Q8_0")]
    local = str(tmp_path / "hf" / "Q8_0" / "a-00001-of-00002.gguf")
    client.emit(p.DownloadFinished(repo, local))
    client.emit(estimate(local))
    qtbot.waitUntil(lambda: dialog.quant_file.itemText(1).endswith("(downloaded)"), timeout=5000)
    assert dialog.quant_file.currentData() == "Q8_0" and dialog.use_button.isEnabled()
    assert not dialog.download_button.isEnabled()
    qtbot.mouseClick(dialog.use_button, LEFT)
    [load] = client.of(p.LoadModel)
    assert (load.path, load.budget) == (local, "12GiB")


@pytest.mark.process
def test_library_screenshot_mode_selects_the_model_and_saves_the_dialog(tmp_path):
    import os
    import subprocess
    import sys

    from PySide6.QtGui import QImage

    from tests.helpers.library_ggufs import write_moe_gguf

    home = tmp_path / "home"
    name = "pub/Tiny-GGUF/tiny-Q8_0.gguf"
    write_moe_gguf(home / ".lmstudio" / "models" / name)
    out = tmp_path / "library.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", HOME=str(home), HF_HUB_CACHE=str(tmp_path / "hf"))
    result = subprocess.run([sys.executable, "-m", "app", "--screenshot", str(out), "--library", name, "--timeout", "240"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [name, "downloaded", report["rows"][-1][2], "LM Studio", "Q8_0", "fits in RAM"] == report["rows"][-1][:6]
    assert report["verdict"].startswith("fits in RAM") and not QImage(str(out)).isNull()
