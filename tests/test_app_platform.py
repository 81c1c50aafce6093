"""Opening the window on a real display: Qt's xcb platform under Xvfb, and the one line `moescope`
says instead of Qt's abort where no platform can load (a missing library, no display)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app import platform_check
from app.platform_check import EXIT_NO_WINDOW, platforms_to_try, window_problem
from tests.helpers.window_report import assert_heatmap_drawn, screenshot_report
from tests.helpers.xvfb import xvfb_display

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is 7 plus 5?"  # the demo model knows the addition table up to 12 + 12
QT_ENV = ("QT_QPA_PLATFORM", "QT_PLUGIN_PATH", "QT_QPA_PLATFORM_PLUGIN_PATH", "DISPLAY", "WAYLAND_DISPLAY",
          "XDG_SESSION_TYPE", "QT_DEBUG_PLUGINS")


def _env(**settings: str) -> dict[str, str]:
    """This environment without anything that picks Qt's platform, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if k not in QT_ENV}
    env.update(settings)
    return env


def _moescope(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout, check=False)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == EXIT_NO_WINDOW, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("moescope: cannot open the window: "), lines[0]
    assert "moescope chat --model demo" in lines[0]  # what works meanwhile
    assert "Reinstalling the application" not in lines[0] and "Aborted" not in result.stderr
    return lines[0]


# ----------------------------------------------------------------- the real window on xcb


@pytest.mark.process
def test_window_opens_on_xcb_answers_and_draws_the_heatmap(tmp_path):
    with xvfb_display() as display:
        env = _env(QT_QPA_PLATFORM="xcb", DISPLAY=display, TMPDIR=str(tmp_path))
        out = tmp_path / "window.png"
        result = _moescope(env, "--screenshot", str(out), "--prompt", PROMPT, "--model", "demo", "--timeout", "300",
                           timeout=420)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = screenshot_report(result.stdout)
    assert report["platform"] == "xcb"  # Qt connected to the X server, not offscreen
    assert re.search(r"\b12\b", report["reply"]), report["reply"]
    assert_heatmap_drawn(out, report)


# ----------------------------------------------------------------- one line where it cannot open


def _plugin_missing_a_library(tmp_path: Path) -> tuple[Path, str]:
    """A copy of PySide6's real libqxcb.so whose DT_NEEDED names a library that is nowhere: the plugin
    folder for QT_PLUGIN_PATH and the soname. (Qt finds the copy first and does not fall back.)"""
    qt = Path(platform_check.qt_plugins_folder()).parent
    data = (qt / "plugins" / "platforms" / "libqxcb.so").read_bytes()
    needed, gone = b"libxcb-icccm.so.4\0", b"libxcb-icccm.so.9\0"  # same length: the string table stays valid
    assert data.count(needed) == 1, "libqxcb.so no longer links libxcb-icccm.so.4 by that name"
    plugins = tmp_path / "qt" / "plugins"
    (plugins / "platforms").mkdir(parents=True)
    (plugins / "platforms" / "libqxcb.so").write_bytes(data.replace(needed, gone))
    (tmp_path / "qt" / "lib").symlink_to(qt / "lib")  # its RUNPATH, $ORIGIN/../../lib, finds Qt's own libraries
    return plugins, gone.rstrip(b"\0").decode()


def test_missing_library_is_one_line_with_the_fix(tmp_path):
    plugins, soname = _plugin_missing_a_library(tmp_path)
    env = _env(QT_QPA_PLATFORM="xcb", DISPLAY=":0", QT_PLUGIN_PATH=str(plugins))

    # Without the check, Qt aborts with its generic message: the situation is real.
    qt_alone = subprocess.run([sys.executable, "-c", "from PySide6.QtWidgets import QApplication; QApplication([])"],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
    assert qt_alone.returncode != 0 and "no Qt platform plugin could be initialized" in qt_alone.stderr

    line = _one_line(_moescope(env))
    assert f"Qt's xcb platform needs {soname}, which is not installed" in line
    assert f"apt-file search {soname}" in line
    # install.sh's question, asked with no display: the same line.
    del env["DISPLAY"]
    assert _one_line(_moescope(env, "--check-libraries")) == line


def test_install_command_names_the_debian_packages():
    hint = platform_check.install_hint(["libxcb-cursor.so.0", "libxcb-icccm.so.4", "libwayland-cursor.so.0"])
    assert hint == "install them with: sudo apt-get install libxcb-cursor0 libxcb-icccm4 libwayland-cursor0"
    assert platform_check.install_hint(["libxcb-icccm.so.4"]) == "install it with: sudo apt-get install libxcb-icccm4"
    assert "pip install --force-reinstall PySide6-Essentials" in platform_check.install_hint(["libQt6XcbQpa.so.6"])


def test_every_library_the_xcb_plugin_links_has_a_package():
    """The table covers what this PySide6's libqxcb.so links outside Qt (so a missing one gets its apt line)."""
    plugin = platform_check.qt_plugins_folder() / "platforms" / "libqxcb.so"
    if not plugin.is_file():
        pytest.skip("this PySide6 has no xcb plugin")
    linked = re.findall(r"NEEDED\s+(\S+)", subprocess.run(["objdump", "-p", str(plugin)], capture_output=True,
                                                          text=True, check=False).stdout)
    if not linked:
        pytest.skip("objdump is not installed (binutils)")
    system = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1"}
    unmapped = [s for s in linked if not s.startswith(platform_check.QT_OWN) and s not in system
                and s not in platform_check.DEBIAN_PACKAGES]
    assert not unmapped


def test_no_display_is_one_line_naming_both_variables():
    line = _one_line(_moescope(_env()))
    assert "neither DISPLAY nor WAYLAND_DISPLAY is set" in line


def test_unreachable_display_is_one_line_from_qt_itself(tmp_path):
    """A DISPLAY no server answers on gets past the check; Qt's own failure becomes the one line."""
    free = next(n for n in range(4242, 4342) if not Path(f"/tmp/.X11-unix/X{n}").exists())
    env = _env(QT_QPA_PLATFORM="xcb", DISPLAY=f":{free}")
    line = _one_line(_moescope(env))
    if window_problem(env) is None:  # the libraries are here: Qt tried to connect and said why it could not
        assert f"could not connect to display :{free}" in line


def test_platforms_follow_qts_choice():
    assert platforms_to_try({"QT_QPA_PLATFORM": "offscreen"}) == ["offscreen"]
    assert platforms_to_try({"QT_QPA_PLATFORM": "wayland;xcb"}) == ["wayland", "xcb"]
    assert platforms_to_try({"DISPLAY": ":0"}) == ["xcb"]
    assert platforms_to_try({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}) == ["wayland", "xcb"]
    assert window_problem({"QT_QPA_PLATFORM": "offscreen", "PATH": os.defpath}) is None  # what the GUI tests use
    assert "needs DISPLAY" in window_problem({"QT_QPA_PLATFORM": "xcb", "PATH": os.defpath})


def test_other_systems_are_left_to_qt(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")  # no DISPLAY there, and the window opens all the same
    assert window_problem({}) is None
    assert platform_check.library_problem({}) is None
