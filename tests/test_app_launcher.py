"""`moescope` dispatch, and the GUI's promise never to import torch or the engine's internals."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from app import launcher

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_ENGINE_IMPORTS = {"engine", "engine.protocol", "engine.process.client", "engine.accounting.planner", "engine.accounting.sizes",
                          # the torch-free server and remote client (tests/test_structure.py holds them torch-free)
                          "engine.errors", "engine.serve", "engine.serve.app", "engine.serve.hub", "engine.serve.runner",
                          "engine.remote.client",
                          "engine.formats.blocks",  # the weight formats' names, labels and sizes (numpy only)
                          "engine.demo.corpus",  # the demo's example prompts (stdlib only)
                          "engine.system.process_exit"}  # the exit without the final collection (gc only)


def test_subcommands_go_to_the_engine_cli(monkeypatch):
    seen: list = []
    import engine.cli.main

    monkeypatch.setattr(engine.cli.main, "main", lambda argv: seen.append(list(argv)) or 7)
    assert launcher.main(["generate", "--model", "demo", "--prompt", "hi"]) == 7
    assert launcher.main(["policies"]) == 7
    assert seen == [["generate", "--model", "demo", "--prompt", "hi"], ["policies"]]


def test_gui_flags_go_to_the_window(monkeypatch):
    import app.gui

    runs: list = []
    monkeypatch.setattr(app.gui, "run_gui", lambda args: runs.append(args) or 0)
    assert launcher.main([]) == 0
    assert launcher.main(["--screenshot", "out.png", "--prompt", "hello", "--model", "m", "--budget", "2GiB"]) == 0
    assert runs[0].model is None and runs[0].screenshot is None
    assert (runs[1].screenshot, runs[1].prompt, runs[1].model, runs[1].budget) == ("out.png", "hello", "m", "2GiB")
    assert launcher.main(["--screenshot", "out.png"]) == 2  # a screenshot needs a prompt
    assert launcher.is_engine_command(["info"]) and not launcher.is_engine_command(["--model", "x"])


def test_pyproject_entry_point_is_the_launcher():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'moescope = "app.launcher:entry"' in text


def test_app_sources_import_only_the_engine_contract():
    for path in sorted((ROOT / "app").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from engine.x import y`: y may be a module
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in ALLOWED_ENGINE_IMPORTS else node.module
                         for a in node.names]
            for name in names:
                root = name.split(".")[0]
                assert root not in ("torch", "transformers"), f"{path}: imports {name}"
                if root == "engine" and name != "engine.cli.main":  # the launcher's lazy CLI hand-off
                    assert name in ALLOWED_ENGINE_IMPORTS, f"{path}: imports {name}"


@pytest.mark.parametrize("extra", ["", "from app.models.budget_estimate import _planner; _planner()"])
def test_opening_the_window_modules_never_imports_torch(extra):
    code = (
        "import sys\n"
        "import app.launcher, app.gui, app.main_window, app.screenshot\n"
        f"{extra}\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
