"""The desktop packaging: menu entry, AppStream metadata, icons, install script, and (slow) the bundle.

Fast tests check the files under packaging/ (desktop-file-validate when installed). The slow ones
build the PyInstaller bundle with packaging/build.sh (minutes) and run it: a screenshot of a real
reply from the frozen app, and the installed menu entry's Exec line under Xvfb. Set
MOESCOPE_BUNDLE=/path/to/MoEScope to test an already built bundle instead of building one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.window_report import assert_heatmap_drawn, screenshot_report
from tests.helpers.xvfb import start_xvfb, stop_xvfb, xvfb_display

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
LINUX = PACKAGING / "linux"
ICONS = PACKAGING / "icons"
DESKTOP_ID = "moescope.desktop"
APP_ID = "io.github.moescope.MoEScope"
PNG_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
PROMPT = "What is 7 + 5?"  # the demo model knows the addition table up to 12 + 12


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def read_desktop(path: Path) -> dict[str, str]:
    entries, group = {}, None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            group = line.strip("[]")
        elif "=" in line and group == "Desktop Entry":
            key, _, value = line.partition("=")
            entries[key.strip()] = value.strip()
    return entries


def desktop_file_validate(path: Path) -> None:
    tool = shutil.which("desktop-file-validate")
    if tool is None:
        pytest.skip("desktop-file-validate is not installed (apt-get install desktop-file-utils)")
    result = subprocess.run([tool, str(path)], capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "error:" not in output, output


# ----------------------------------------------------------------- fast: the files themselves


def test_desktop_entries_validate():
    entries = sorted(LINUX.glob("*.desktop"))
    assert [p.name for p in entries] == [DESKTOP_ID]
    for path in entries:
        desktop_file_validate(path)


def test_desktop_entry_fields():
    entry = read_desktop(LINUX / DESKTOP_ID)
    assert entry["Type"] == "Application"
    assert entry["Name"] == "MoEScope"
    assert entry["Icon"] == "moescope"  # the hicolor icon name install.sh installs
    assert entry["Terminal"] == "false"
    assert shlex.split(entry["Exec"])[0] == "moescope"  # install.sh rewrites it to the installed path


def test_metainfo_parses_and_names_the_desktop_id():
    path = LINUX / f"{APP_ID}.metainfo.xml"
    root = ET.parse(path).getroot()
    assert root.tag == "component" and root.get("type") == "desktop-application"
    assert root.findtext("id") == APP_ID
    launchables = [(el.get("type"), el.text) for el in root.findall("launchable")]
    assert ("desktop-id", DESKTOP_ID) in launchables
    assert (LINUX / DESKTOP_ID).is_file()
    assert root.findtext("name") == "MoEScope"
    assert root.findtext("summary")
    assert root.findtext("metadata_license") and root.findtext("project_license")
    assert root.find("description/p") is not None
    assert root.find("releases/release").get("version") == _project_version()


def test_metainfo_passes_appstreamcli():
    tool = shutil.which("appstreamcli")
    if tool is None:
        pytest.skip("appstreamcli is not installed (apt-get install appstream)")
    result = subprocess.run([tool, "validate", "--no-net", str(LINUX / f"{APP_ID}.metainfo.xml")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("size", PNG_SIZES)
def test_icon_png_sizes(size):
    path = ICONS / "hicolor" / f"{size}x{size}" / "apps" / "moescope.png"
    assert path.is_file(), path
    assert png_size(path.read_bytes()) == (size, size)


def test_icon_svg_and_os_icons():
    svg = ET.parse(ICONS / "moescope.svg").getroot()
    assert svg.tag.endswith("svg") and svg.get("viewBox") == "0 0 256 256"
    # Windows .ico: ICONDIR, then one 16-byte entry per image (PNG payloads).
    ico = (ICONS / "moescope.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind) == (0, 1) and count >= 5
    sizes = set()
    for i in range(count):
        width, _, _, _, _, _, length, offset = struct.unpack("<BBBBHHII", ico[6 + 16 * i: 22 + 16 * i])
        w, h = png_size(ico[offset: offset + length])
        assert w == h == (width or 256)
        sizes.add(w)
    assert {16, 32, 48, 256} <= sizes
    # macOS .icns: 'icns' + total length, then (type, length, PNG) records.
    icns = (ICONS / "moescope.icns").read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)
    pos, kinds = 8, {}
    while pos < len(icns):
        kind, length = icns[pos: pos + 4], struct.unpack(">I", icns[pos + 4: pos + 8])[0]
        kinds[kind] = png_size(icns[pos + 8: pos + length])
        pos += length
    assert kinds[b"ic10"] == (1024, 1024) and kinds[b"ic07"] == (128, 128) and kinds[b"icp4"] == (16, 16)


def test_shell_scripts_are_strict_and_parse():
    scripts = [PACKAGING / "build.sh", LINUX / "install.sh", LINUX / "build_appimage.sh", PACKAGING / "macos" / "build.sh",
               ROOT / "engine" / "decode" / "native" / "tests" / "check_arm64.sh"]
    for script in scripts:
        text = script.read_text(encoding="utf-8")
        assert text.startswith("#!/usr/bin/env bash\n"), script
        assert "set -euo pipefail" in text, script
        assert os.access(script, os.X_OK), f"{script} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout


def test_spec_uses_the_frozen_entry():
    spec = (PACKAGING / "moescope.spec").read_text(encoding="utf-8")
    entry = (PACKAGING / "moescope_entry.py").read_text(encoding="utf-8")
    assert "moescope_entry.py" in spec and 'name="MoEScope"' in spec
    assert "NSHighResolutionCapable" in spec
    # freeze_support must run before anything else: the spawned engine worker re-enters here.
    main_block = entry.split('if __name__ == "__main__":', 1)[1]
    assert main_block.strip().startswith("multiprocessing.freeze_support()")


MISSING_LINE = ("moescope: cannot open the window: Qt's xcb platform needs libxcb-cursor.so.0, which is not "
                "installed — install it with: sudo apt-get install libxcb-cursor0")


def _fake_bundle(tmp_path: Path, missing: str = "") -> Path:
    """A bundle whose `moescope --check-libraries` reports `missing` (exit 3) or nothing (exit 0)."""
    bundle = tmp_path / "dist" / "MoEScope"
    (bundle / "_internal").mkdir(parents=True)
    exe = bundle / "moescope"
    check = f"echo {shlex.quote(missing)} >&2; exit 3" if missing else "exit 0"
    exe.write_text(f'#!/bin/sh\nif [ "$1" = --check-libraries ]; then {check}; fi\necho fake moescope "$@"\n')
    exe.chmod(0o755)
    return bundle


def test_install_and_uninstall_into_a_prefix(tmp_path):
    bundle = _fake_bundle(tmp_path)
    prefix = tmp_path / "home with space" / ".local"
    env = {**os.environ, "HOME": str(tmp_path / "home with space")}
    run = [str(LINUX / "install.sh"), "--bundle", str(bundle), "--prefix", str(prefix)]
    result = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stdout + result.stderr  # the bundle found every library it needs
    opt = prefix / "opt" / "moescope"
    assert (opt / "moescope").is_file() and (opt / "_internal").is_dir()
    link = prefix / "bin" / "moescope"
    assert link.is_symlink() and link.resolve() == (opt / "moescope").resolve()
    desktop = prefix / "share" / "applications" / DESKTOP_ID
    entry = read_desktop(desktop)
    assert shlex.split(entry["Exec"]) == [str(opt / "moescope")]  # quoted: the path has a space
    assert entry["TryExec"] == str(opt / "moescope")
    for size in PNG_SIZES:
        assert (prefix / "share" / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "moescope.png").is_file()
    assert (prefix / "share" / "icons" / "hicolor" / "scalable" / "apps" / "moescope.svg").is_file()
    assert (prefix / "share" / "metainfo" / f"{APP_ID}.metainfo.xml").is_file()
    launched = subprocess.run(shlex.split(entry["Exec"]), capture_output=True, text=True, check=True)
    assert launched.stdout.strip() == "fake moescope"
    if shutil.which("desktop-file-validate"):
        desktop_file_validate(desktop)

    result = subprocess.run([*run, "--uninstall"], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert not opt.exists() and not link.exists() and not desktop.exists()
    assert not list((prefix / "share" / "icons" / "hicolor").glob("*/apps/moescope.*"))
    assert bundle.is_dir()  # the source bundle is untouched


def test_install_warns_about_missing_system_libraries(tmp_path):
    bundle = _fake_bundle(tmp_path, missing=MISSING_LINE)
    prefix = tmp_path / "prefix"
    result = subprocess.run([str(LINUX / "install.sh"), "--bundle", str(bundle), "--prefix", str(prefix)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr  # installed anyway: `moescope chat` needs none of them
    assert (prefix / "opt" / "moescope" / "moescope").is_file()
    warning = [line for line in result.stdout.splitlines() if "warning" in line]
    assert warning == ["install.sh: warning: cannot open the window: Qt's xcb platform needs libxcb-cursor.so.0, "
                       "which is not installed — install it with: sudo apt-get install libxcb-cursor0"]


def test_install_refuses_a_missing_bundle(tmp_path):
    result = subprocess.run([str(LINUX / "install.sh"), "--bundle", str(tmp_path / "nope"), "--prefix", str(tmp_path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "no bundle" in result.stderr
    assert not (tmp_path / "opt").exists()


def _project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# ----------------------------------------------------------------- slow: the real bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("MOESCOPE_BUNDLE")
    if prebuilt:
        path = Path(prebuilt)
        assert (path / "moescope").is_file(), f"MOESCOPE_BUNDLE={prebuilt} has no moescope executable"
        return path
    out = tmp_path_factory.mktemp("bundle")
    env = {**os.environ, "PYTHON": sys.executable}
    started = time.monotonic()
    result = subprocess.run([str(PACKAGING / "build.sh"), "--out", str(out)], capture_output=True, text=True,
                            env=env, check=False, timeout=3600)
    print(result.stdout[-2000:], f"\nbuild: {time.monotonic() - started:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert list(out.glob("moescope-*-linux-*.tar.gz")), "no tarball"
    return out / "MoEScope"


def _app_env(tmp_path: Path) -> dict[str, str]:
    """A clean environment: the user's own settings, history and caches stay untouched."""
    home = tmp_path / "home"
    scratch = tmp_path / "tmp"
    home.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), TMPDIR=str(scratch), HF_HUB_OFFLINE="1", QT_QPA_PLATFORM="offscreen")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def _assert_no_dev_tree(bundle: Path) -> None:
    internal = bundle / "_internal"
    for name in ("tests", "bench", ".git", ".venv", ".pytest_cache", ".ruff_cache", "moescope.egg-info"):
        assert not (internal / name).exists() and not (bundle / name).exists(), f"{name} is in the bundle"
    leaked = [p for p in bundle.rglob("*") if p.name in (".git", "__pycache__", ".pytest_cache", ".ruff_cache")
              or p.match("bench/cache") or p.name.startswith("test_packaging")]
    assert not leaked, leaked[:10]
    assert not list(bundle.rglob("libcudart*")) and not list(bundle.rglob("libcublas*")), "CUDA libraries in a CPU build"
    assert (internal / "resources" / "catalog.json").is_file()
    assert list((internal / "transformers" / "models").glob("*/modeling_*.py")), "transformers sources missing"


def _bundle_size(bundle: Path) -> int:
    return sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file() and not p.is_symlink())


def _reply_from_history(scratch: Path) -> str | None:
    """The screenshot run keeps its chat in TMPDIR/moescope-screenshot-*/history.sqlite3."""
    for db in scratch.glob("moescope-screenshot-*/history.sqlite3"):
        with sqlite3.connect(db) as con:
            rows = con.execute("SELECT content FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
        if rows:
            return rows[-1][0]
    return None


@pytest.mark.slow
def test_bundle_screenshot_runs_frozen(bundle, tmp_path):
    """The frozen app opens its window on a real X server (Qt's xcb platform under Xvfb), answers and
    draws the heatmap; its own check of the system libraries finds them all."""
    _assert_no_dev_tree(bundle)
    print(f"bundle size: {_bundle_size(bundle) / 2**20:.0f} MiB")
    out = tmp_path / "out.png"
    env = _app_env(tmp_path)
    checked = subprocess.run([str(bundle / "moescope"), "--check-libraries"], capture_output=True, text=True,
                             env=env, timeout=120, check=False)
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr[-3000:]
    demo = ROOT / "resources" / "models" / "demo"
    has_demo = (demo / "config.json").is_file()
    model_args = [] if has_demo else ["--model", str(_tiny_checkpoint(tmp_path))]  # no demo: any MoE will do
    with xvfb_display() as display:
        env.update(QT_QPA_PLATFORM="xcb", DISPLAY=display)
        started = time.monotonic()
        result = subprocess.run([str(bundle / "moescope"), "--screenshot", str(out), "--prompt", PROMPT, *model_args],
                                capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900, check=False)
    print(f"screenshot run: {time.monotonic() - started:.1f} s\n{result.stderr[-3000:]}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert out.is_file()
    data = out.read_bytes()
    width, height = png_size(data)
    assert width >= 800 and height >= 500 and len(data) > 20_000, (width, height, len(data))
    report = screenshot_report(result.stdout)
    assert report["platform"] == "xcb"
    assert_heatmap_drawn(out, report)
    if has_demo:
        assert "12" in report["reply"], report["reply"]
        assert _reply_from_history(Path(env["TMPDIR"])) == report["reply"]  # and the chat history kept it


def _tiny_checkpoint(tmp_path: Path, family: str = "qwen2_moe") -> Path:
    from tests.helpers.checkpoints import save_tiny_checkpoint

    return save_tiny_checkpoint(family, tmp_path / f"tiny-{family}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_bundle_engine_cli_runs_frozen(bundle, tmp_path, family):
    """The engine subcommands run from the same executable (no window, no Qt), for every tested family:
    the frozen transformers finds each model class and its @use_experts_implementation source."""
    import json

    from tests.helpers.checkpoints import reference_generate

    path = _tiny_checkpoint(tmp_path, family)
    ids = [1, 17, 42, 9, 77, 5, 63, 30, 11]
    result = subprocess.run([str(bundle / "moescope"), "generate", "--model", str(path), "--prompt-ids",
                             ",".join(map(str, ids)), "--raw", "--max-new-tokens", "8", "--budget", "30%", "--json"],
                            capture_output=True, text=True, env=_app_env(tmp_path), timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["token_ids"] == reference_generate(path, ids, 8)  # exact, frozen too


@pytest.mark.slow
def test_bundle_decodes_on_its_native_kernels_with_an_empty_environment(bundle, tmp_path):
    """`env -i`: no PATH (so no compiler), no HOME, no cache; the bundle's own kernel libraries run
    the whole-token step, and `info` names the variant it loaded."""
    import json

    from engine.decode.native import library

    if not library.variants():
        pytest.skip("this checkout built no native kernels to bundle (pip install -e . builds them)")
    path = _tiny_checkpoint(tmp_path, "mixtral")
    run = ["env", "-i", f"TMPDIR={tmp_path}", str(bundle / "moescope"), "generate", "--model", str(path),
           "--prompt-ids", "1,17,42,9", "--raw", "--max-new-tokens", "8", "--dtype", "bfloat16", "--json"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["decode_path"] == "fast: whole token in one native call", out["decode_path_reason"]
    assert out["kernels"]["variant"] == library.choose().variant.name
    info = subprocess.run(["env", "-i", str(bundle / "moescope"), "info", "--model", str(path)], capture_output=True,
                          text=True, timeout=600, check=False, cwd=tmp_path)
    assert info.returncode == 0 and f"native kernels   {out['kernels']['variant']}" in info.stdout, info.stderr[-2000:]


@pytest.mark.slow
def test_installed_desktop_entry_launches(bundle, tmp_path):
    home = tmp_path / "home"
    env = _app_env(tmp_path)
    result = subprocess.run([str(LINUX / "install.sh"), "--bundle", str(bundle)], capture_output=True, text=True,
                            env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    desktop = home / ".local" / "share" / "applications" / DESKTOP_ID
    desktop_file_validate(desktop)
    exec_line = shlex.split(read_desktop(desktop)["Exec"])
    assert exec_line == [str(home / ".local" / "opt" / "moescope" / "moescope")]
    assert (home / ".local" / "bin" / "moescope").resolve() == Path(exec_line[0]).resolve()

    # Launch it as a menu would: the Exec line as is, on a real X server when Xvfb is installed.
    xvfb = start_xvfb() if shutil.which("Xvfb") else None
    if xvfb is not None:
        env.pop("QT_QPA_PLATFORM")
        env["DISPLAY"] = xvfb[1]
    process = subprocess.Popen(exec_line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    windows = ""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(2)
            if xvfb is None or not shutil.which("xwininfo"):
                windows = "not checked"
                if time.monotonic() > deadline - 40:
                    break  # offscreen: no window list; staying up for 20 s is the check
                continue
            windows = subprocess.run(["xwininfo", "-root", "-tree"], capture_output=True, text=True, env=env,
                                     check=False).stdout
            if '"MoEScope"' in windows:
                time.sleep(5)  # and it stays up with the engine running
                break
        alive = process.poll() is None
    finally:
        os.killpg(process.pid, 15)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            _, stderr = process.communicate()
        if xvfb is not None:
            stop_xvfb(xvfb[0])
    assert alive, f"the app exited with {process.returncode}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    if windows != "not checked":
        # A top-level window titled MoEScope, whose WM_CLASS is the .desktop file's StartupWMClass.
        startup_wm_class = read_desktop(desktop)["StartupWMClass"]
        assert '"MoEScope"' in windows and f'"{startup_wm_class}")' in windows, windows[-3000:]

    result = subprocess.run([str(LINUX / "install.sh"), "--uninstall"], capture_output=True, text=True, env=env,
                            check=False)
    assert result.returncode == 0 and not desktop.exists()
