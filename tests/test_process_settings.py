"""Process-wide settings are made by the entry points, not by importing the engine."""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.system.process_settings import MKL_REPRODUCIBLE, apply_process_settings

ROOT = Path(__file__).resolve().parents[1]
NAME, VALUE = MKL_REPRODUCIBLE


def _env_without_setting() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != NAME}


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env_without_setting(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_engine_sets_nothing() -> None:
    out = _python(f"import os, engine, engine.protocol, engine.cli.main; print(os.environ.get({NAME!r}))")
    assert out == "None"


def test_apply_sets_the_mode_and_keeps_a_users_value(monkeypatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    apply_process_settings()
    apply_process_settings()  # again: nothing changes
    assert os.environ[NAME] == VALUE
    monkeypatch.setenv(NAME, "COMPATIBLE")
    apply_process_settings()
    assert os.environ[NAME] == "COMPATIBLE"


def test_cli_main_applies_it(monkeypatch, capsys) -> None:
    from engine.cli.main import main

    monkeypatch.delenv(NAME, raising=False)
    assert main([]) == 0  # no command: the help, and nothing else
    assert os.environ[NAME] == VALUE


def test_engine_process_applies_it_before_the_worker_runs(monkeypatch) -> None:
    import engine.process.worker as worker
    import engine.system.process_exit as process_exit
    from engine.process import worker_entry

    seen: list[str | None] = []

    class FakeWorker:
        def __init__(self, conn) -> None:
            pass

        def run(self) -> None:
            seen.append(os.environ.get(NAME))

    monkeypatch.delenv(NAME, raising=False)
    monkeypatch.setattr(worker, "Worker", FakeWorker)
    monkeypatch.setattr(process_exit, "exit_process", lambda code: None)
    worker_entry.main(None)
    assert seen == [VALUE]


def _runnable_modules() -> list[Path]:
    """The engine's and the benchmarks' modules that run as programs (`python -m ...`)."""
    found = []
    for folder in ("engine", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if 'if __name__ == "__main__":' in path.read_text():
                found.append(path)
    return found


@pytest.mark.parametrize("path", _runnable_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_program_applies_it_first(path: Path) -> None:
    tree = ast.parse(path.read_text())
    (main,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    body = main.body[1:] if ast.get_docstring(main) else main.body
    first = body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), ast.unparse(first)
    assert ast.unparse(first.value.func) == "apply_process_settings", ast.unparse(first)


def test_mkl_takes_the_mode_set_after_torch_is_imported() -> None:
    """MKL reads the setting at its first product, so an entry point that imports torch first is still in
    time. Asked of MKL itself where torch exports its query (a build that does not is skipped)."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    try:
        ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_serv_cbwr_get  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("this torch build does not export MKL's reproducibility query")
    out = _python(
        "import ctypes, pathlib, torch\n"
        "from engine.system.process_settings import apply_process_settings\n"
        "torch.set_num_threads(1)\n"
        "apply_process_settings()\n"
        "a = torch.randn(64, 64)\n"
        "a @ a\n"
        "lib = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / 'lib' / 'libtorch_cpu.so'))\n"
        "print(lib.mkl_serv_cbwr_get(-1))\n"  # MKL_CBWR_ALL: the branch and the strict flag
    )
    assert int(out) == 0x10002  # MKL_CBWR_AUTO | MKL_CBWR_STRICT
