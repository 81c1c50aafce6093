"""What a newcomer meets first on the command line: the help, the catalog, naming a model, an empty
prompt, a file that is not what its name says, the Hub out of reach. Each asserts the lines the user
reads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.launcher import ENGINE_COMMANDS_HINT, build_gui_parser
from engine.cli.main import build_parser
from engine.cli.main import main as moescope
from tests.helpers.gguf_writer import save_tiny_hf, write_gguf
from tests.helpers.hub.library_hub import place_in_cache
from tests.helpers.library_ggufs import write_ollama_model

ACCEPTS = ("a checkpoint folder", "a .gguf file", "a downloaded Hub id (org/name)", "`moescope models list`", "'demo'")


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = moescope(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moescope: error: "), err
    return lines[0].removeprefix("moescope: error: ")


# ----------------------------------------------------------------------------- the help


def test_the_help_names_only_commands_that_exist():
    epilog = build_gui_parser().format_help()
    assert "bench" not in ENGINE_COMMANDS_HINT and "python -m bench.NAME" in " ".join(epilog.split())
    named = {word.strip() for word in ENGINE_COMMANDS_HINT.split(",")}
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert named == set(commands)
    for word in named:  # and each of them answers --help
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([word, "--help"])
        assert done.value.code == 0


def test_model_help_says_what_model_takes(capsys):
    window = " ".join(build_gui_parser().format_help().split())
    with pytest.raises(SystemExit):
        moescope(["generate", "--help"])
    generate = " ".join(capsys.readouterr().out.split())
    for text in (window, generate):
        for words in ACCEPTS:
            assert words in text, words


def test_a_missing_model_names_what_model_accepts(capsys, tmp_path):
    for ref in ("qwen3moe-test:q4", str(tmp_path / "nowhere")):
        code, _, err = run(capsys, "generate", "--model", ref, "--prompt-ids", "1,2", "--max-new-tokens", "1")
        line = one_error_line(err)
        assert code == 2 and line.startswith(f"model path '{ref}' does not exist; pass ")
        for words in ACCEPTS:
            assert words in line, words


# ----------------------------------------------------------------------------- the catalog


def test_the_catalog_calls_gpt_oss_runnable_as_the_engine_runs_its_mxfp4(capsys):
    from engine.hub.supported import RUNNABLE_QUANTIZATIONS

    code, out, _ = run(capsys, "models", "list", "--json")
    rows = {row["repo"]: row for row in json.loads(out)}
    oss = rows["openai/gpt-oss-20b"]["description"]
    assert code == 0 and "mxfp4" in RUNNABLE_QUANTIZATIONS  # tests/test_quantized_checkpoints.py runs one
    assert "MXFP4" in oss and "not runnable" not in oss
    # what runs here is the verdict's to say, from the config: no description claims otherwise
    assert not [r for r in rows.values() if r["in_catalog"] and "not runnable" in r["description"]]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("option", "value", "line"), [
    ("--prompt", "", "--prompt is empty; pass the text to send, e.g. --prompt 'What is 4 plus 7?'"),
    ("--prompt", "  \n ", "--prompt is empty; pass the text to send, e.g. --prompt 'What is 4 plus 7?'"),
    ("--prompt-ids", " , ", "--prompt-ids is empty; pass the token ids to send, e.g. --prompt-ids 1,2,3"),
])
def test_an_empty_prompt_is_refused_before_anything_loads(capsys, tmp_path, option, value, line):
    # a model path that does not exist: the prompt is refused first, so nothing was loaded
    code, out, err = run(capsys, "generate", "--model", str(tmp_path / "nowhere"), option, value)
    assert code == 2 and out == "" and one_error_line(err) == line


def test_a_file_named_gguf_that_is_not_one_gets_one_clean_line(capsys, tmp_path):
    fake = tmp_path / "model-Q4_K_M.gguf"
    fake.write_text("<html>Sign in to download</html>")  # what a failed download often leaves
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for command in (["generate", "--model", str(fake), "--prompt-ids", "1"], ["info", "--model", str(fake)],
                    ["models", "info", str(fake)]):
        code, _, err = run(capsys, *command)
        assert code == 2 and one_error_line(err) == (
            f"{fake} is not a readable GGUF file: it does not begin with the GGUF magic bytes; download it again")
    code, _, err = run(capsys, "info", "--model", str(empty))
    assert code == 2 and one_error_line(err) == f"{empty} is truncated inside its header; download it again"


def test_a_prompt_longer_than_the_context_gets_moescopes_line_alone():
    # a subprocess: transformers' warning goes through its own logging handlers, as it would for a user
    text = "a" * 600  # the demo's tokenizer is per character; its context is 512
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "--model", "demo", "--prompt", text],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moescope: error: the prompt is 608 tokens but this model's context is 512 tokens; shorten it"]


# ----------------------------------------------------------------------------- names the library shows


@pytest.fixture
def other_apps(tmp_path, monkeypatch) -> dict[str, Path]:
    """One runnable GGUF where LM Studio, Ollama and the HF cache keep theirs; the names the library gives them."""
    home, cache, store = tmp_path / "home", tmp_path / "hf-cache", tmp_path / "ollama"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    source = tmp_path / "src" / "tiny-mixtral-Q8_0.gguf"
    source.parent.mkdir()
    write_gguf(save_tiny_hf("mixtral", tmp_path / "hf"), source)
    lmstudio = home / ".lmstudio" / "models" / "someone" / "Tiny-GGUF" / source.name
    lmstudio.parent.mkdir(parents=True)
    lmstudio.write_bytes(source.read_bytes())
    blob = write_ollama_model(store, source, "qwen3moe-test", "q4")
    write_ollama_model(store, source, "tiny")  # :latest, which `ollama run tiny` means too
    snapshot = place_in_cache(cache, "org/Tiny-GGUF", source.parent)
    return {"someone/Tiny-GGUF/tiny-mixtral-Q8_0.gguf": lmstudio, "qwen3moe-test:q4": blob, "tiny:latest": blob,
            "org/Tiny-GGUF/tiny-mixtral-Q8_0.gguf": snapshot / source.name}


def test_every_name_the_library_shows_opens_with_model(capsys, other_apps):
    code, out, _ = run(capsys, "models", "list", "--json")
    listed = {row["repo"]: row["path"] for row in json.loads(out) if row.get("source")}
    assert code == 0 and listed == {name: str(path) for name, path in other_apps.items()}
    for name in [*listed, "tiny"]:
        code, out, err = run(capsys, "generate", "--model", name, "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                             "--json", "--temperature", "0")
        assert code == 0, err
        assert len(json.loads(out)["token_ids"]) == 3


def test_a_listed_name_that_cannot_open_says_why(capsys, other_apps):
    other_apps["qwen3moe-test:q4"].unlink()  # the blob both Ollama names point at
    code, _, err = run(capsys, "generate", "--model", "qwen3moe-test:q4", "--prompt-ids", "1")
    blob = other_apps["qwen3moe-test:q4"]
    assert code == 2 and one_error_line(err) == (
        f"Ollama's model file {blob.name} for qwen3moe-test:q4 is missing from {blob.parent}; "
        "`ollama pull qwen3moe-test:q4` again")


# ----------------------------------------------------------------------------- the Hub out of reach


class CountingServer:
    """A TCP endpoint that accepts and hangs up at once, counting the connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            self.connections += 1
            conn.close()

    def __enter__(self) -> CountingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not, on Linux)
        self.thread.join()
        self.sock.close()


@pytest.fixture
def online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_search_with_the_hub_out_of_reach_tries_once(capsys, monkeypatch, online):
    with CountingServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        code, out, err = run(capsys, "models", "search", "qwen")
    assert server.connections == 1  # huggingface_hub's listing alone retries 5 times, with backoff
    assert code == 2 and out == "" and one_error_line(err) == (
        f"cannot reach the Hugging Face Hub at {server.url} for 'qwen': check your internet connection or proxy "
        "and try again; models already downloaded still work offline")


def test_search_offline_contacts_nothing(capsys, monkeypatch):
    with CountingServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        code, _, err = run(capsys, "models", "search", "qwen")  # conftest sets HF_HUB_OFFLINE=1
    assert server.connections == 0
    assert code == 2 and one_error_line(err).startswith("HF_HUB_OFFLINE is set, so the Hub is not contacted")
