"""A third-party OpenAI-compatible server: llama-cpp-python's `llama_cpp.server`, built from its sdist
(it vendors llama.cpp), on a GGUF of a tiny Mixtral, and the window chatting with it as a remote engine.

Slow (not in CI): the first run builds llama.cpp (CMake, 8+ minutes on 2 cores) into a cache folder,
`$MOESCOPE_SLOW_CACHE` (default ~/.cache/moescope-slow-tests), kept for later runs. Needs a C++
compiler and PyPI (llama-cpp-python's sdist, its build requirements, sentencepiece).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from engine import protocol as p
from tests.helpers.checkpoints import save_tiny_checkpoint
from tests.helpers.remote_window import connected, say, window_for

pytestmark = [pytest.mark.slow, pytest.mark.process]

VERSION = "0.3.36"
CACHE = Path(os.environ.get("MOESCOPE_SLOW_CACHE", Path.home() / ".cache" / "moescope-slow-tests")) / f"llama-cpp-{VERSION}"
BUILD_S = 3600


def run(*args, timeout: float = BUILD_S, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], check=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def llama_cpp() -> tuple[Path, Path]:
    """(the venv's python with llama_cpp.server, the unpacked sdist with the vendored llama.cpp)."""
    python, source = CACHE / "venv" / "bin" / "python", CACHE / "src"
    if not (CACHE / "built").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        run(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", CACHE / "sdist",
            f"llama-cpp-python=={VERSION}")
        sdist = next((CACHE / "sdist").glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE / "unpacked", filter="data")
        (CACHE / "unpacked" / sdist.name.removesuffix(".tar.gz")).rename(source)
        run(sys.executable, "-m", "venv", CACHE / "venv")
        run(python, "-m", "pip", "install", f"{source}[server]",
            env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2", "CMAKE_ARGS": "-DGGML_NATIVE=ON"})
        (CACHE / "built").touch()
    return python, source


@pytest.fixture(scope="module")
def gguf(llama_cpp, tmp_path_factory) -> Path:
    """The tiny Mixtral with a SentencePiece tokenizer (one llama.cpp converts), as GGUF (f32)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    _, source = llama_cpp
    folder = tmp_path_factory.mktemp("llama-cpp") / "tiny-mixtral"
    folder.mkdir()
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(f"Hello there, how are you today? The number is {i}." for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=96,
                                   model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    corpus.unlink()
    save_tiny_checkpoint("mixtral", folder, vocab_size=96 + 256)  # byte-fallback pieces are part of the vocabulary
    tokenizer = LlamaTokenizer(vocab_file=str(folder / "tokenizer.model"))
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer.save_pretrained(folder)
    out = folder.with_suffix(".gguf")
    run(sys.executable, source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py", folder, "--outfile", out,
        "--outtype", "f32", env={**os.environ, "PYTHONPATH": str(source / "vendor" / "llama.cpp" / "gguf-py")},
        timeout=600)
    return out


@pytest.fixture(scope="module")
def llama_server(llama_cpp, gguf):
    python, _ = llama_cpp
    process = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port",
                                str(_free_port()), "--n_ctx", "256", "--chat_format", "chatml"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            if match := re.search(r"Uvicorn running on (http://\S+)", line):
                url.append(match.group(1) + "/v1")
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(300) and url, "llama_cpp.server did not start"
    yield url[0]
    process.terminate()
    process.wait(30)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_window_chats_with_llama_cpp_server(qtbot, tmp_path, llama_server):
    window, events = window_for(qtbot, tmp_path)
    connected(qtbot, window, llama_server)
    assert "remote engine" in window.model_bar.details.text()
    window.chat_view.settings.max_tokens.setValue(8)
    done = say(qtbot, window, events, "Hello there")
    assert isinstance(done, p.Done) and done.finish_reason in ("stop", "length")
    assert window.chat_view.widgets()[-1].text == done.text and done.stats.decode_tokens > 0
    assert "No routing from this server yet" in window.heatmap.scale_label.text()  # llama.cpp reports none
