"""Can Qt open a window here? Checked before any Qt object exists, so a missing system library or a
missing display ends in one line that says what to do, instead of Qt's abort ("Could not load the Qt
platform plugin "xcb" ... Reinstalling the application may fix this problem.").

Qt-free on purpose (stdlib only): the launcher calls it before importing the window's modules.
Linux only: macOS and Windows have one platform each and no such libraries to miss.

The check mirrors what Qt 6 does in QGuiApplication: the platforms it tries are QT_QPA_PLATFORM's
(';'-separated), else wayland when WAYLAND_DISPLAY is set (or XDG_SESSION_TYPE=wayland) followed by
xcb when DISPLAY is set, else its default, xcb. A platform can start when one of its plugin files
has every shared library it links resolvable by the dynamic loader (``ldd``). It only reports what
it is sure of: a plugin it cannot find, or an ``ldd`` that cannot run, is left to Qt; the window's
own fallback (``startup_failure_line``, fed by Qt's messages) covers what gets past it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

EXIT_NO_WINDOW = 3  # `moescope` exit status when the window cannot open (2 is a usage error)

PREFIX = "moescope: cannot open the window: "
MEANWHILE = "(meanwhile `moescope chat --model demo` works in a terminal)"

# Every system library the xcb and Wayland platform plugins of PySide6 6.11 (and the Qt libraries
# they load) link, from `objdump -p` of the plugins, and its Debian/Ubuntu package (`dpkg -S`).
# tests/test_app_platform.py checks it covers every library the installed libqxcb.so links.
DEBIAN_PACKAGES: dict[str, str] = {
    "libxcb.so.1": "libxcb1",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-glx.so.0": "libxcb-glx0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libX11.so.6": "libx11-6",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libwayland-client.so.0": "libwayland-client0",
    "libwayland-cursor.so.0": "libwayland-cursor0",
    "libwayland-egl.so.1": "libwayland-egl1",
    # What Qt itself needs, even offscreen:
    "libGL.so.1": "libgl1",
    "libEGL.so.1": "libegl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
    "libgthread-2.0.so.0": "libglib2.0-0",
}

QT_OWN = ("libQt6", "libpyside6", "libshiboken6")
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


def platforms_to_try(env: Mapping[str, str]) -> list[str]:
    """The platform plugins Qt will try, in its order (names as in QT_QPA_PLATFORM, arguments kept)."""
    chosen = env.get("QT_QPA_PLATFORM", "")
    if chosen:
        return [name for name in chosen.split(";") if name]
    order = []
    if env.get("WAYLAND_DISPLAY") or env.get("XDG_SESSION_TYPE") == "wayland":
        order.append("wayland")
    if env.get("DISPLAY"):
        order.append("xcb")
    return order or ["xcb"]


def _base(platform: str) -> str:
    return platform.split(":", 1)[0]


def _plugin_names(platform: str) -> list[str]:
    base = _base(platform)
    if base.startswith("wayland"):  # one plugin since Qt 6.8; libqwayland-{generic,egl}.so before
        return ["libqwayland.so", "libqwayland-generic.so", "libqwayland-egl.so"]
    return [f"libq{base}.so"]


def qt_plugins_folder() -> Path | None:
    """PySide6's own Qt plugins folder (in a PyInstaller bundle too)."""
    spec = importlib.util.find_spec("PySide6")  # finds the package without importing Qt
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "Qt" / "plugins"


def plugin_files(platform: str, env: Mapping[str, str]) -> list[Path]:
    """The plugin files Qt may load for `platform`; it starts when one of them loads.

    Measured with QT_DEBUG_PLUGINS on PySide6 6.11: of the folders in QT_PLUGIN_PATH and PySide6's own,
    Qt takes the first plugin it finds and never falls back to a later one (a broken libqxcb.so in
    QT_PLUGIN_PATH aborts even though PySide6's own would load); a plugin in QT_QPA_PLATFORM_PLUGIN_PATH
    is tried besides that one."""
    names = _plugin_names(platform)
    direct = [Path(p) for p in env.get("QT_QPA_PLATFORM_PLUGIN_PATH", "").split(os.pathsep) if p]
    searched = [Path(p) / "platforms" for p in env.get("QT_PLUGIN_PATH", "").split(os.pathsep) if p]
    bundled = qt_plugins_folder()
    if bundled is not None:
        searched.append(bundled / "platforms")
    found = [folder / name for folder in searched for name in names if (folder / name).is_file()]
    return [folder / name for folder in direct for name in names if (folder / name).is_file()] + found[:1]


def unresolved_libraries(library: Path, env: Mapping[str, str]) -> list[str] | None:
    """Sonames `library` links that the dynamic loader cannot find; None when ldd cannot tell."""
    ldd = shutil.which("ldd", path=env.get("PATH") or os.defpath)
    if ldd is None:
        return None
    try:
        result = subprocess.run([ldd, str(library)], capture_output=True, text=True, env=dict(env), timeout=20,
                                check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    missing = list(dict.fromkeys(_NOT_FOUND.findall(result.stdout)))
    if result.returncode != 0 and not missing:
        return None  # not a dynamic library ldd understands: leave it to Qt
    return missing


def install_hint(sonames: Sequence[str]) -> str:
    """How to install the libraries: the apt-get line for the ones we know, apt-file for the rest."""
    packages = list(dict.fromkeys(DEBIAN_PACKAGES[s] for s in sonames if s in DEBIAN_PACKAGES))
    own = [s for s in sonames if s.startswith(QT_OWN)]
    unknown = [s for s in sonames if s not in DEBIAN_PACKAGES and s not in own]
    them = "it" if len(sonames) == 1 else "them"
    hints = []
    if own:  # Qt's own libraries ship with PySide6 (or the bundle): no system package has them
        hints.append("reinstall MoEScope" if getattr(sys, "frozen", False)
                     else "reinstall PySide6 with: pip install --force-reinstall PySide6-Essentials")
    if packages:
        hints.append(f"install {them} with: sudo apt-get install {' '.join(packages)}")
    if unknown:
        hints.append(f"find the package{'s' if len(unknown) > 1 else ''} with: apt-file search {' '.join(unknown)}")
    return "; ".join(hints)


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def window_problem(env: Mapping[str, str] | None = None) -> str | None:
    """One line saying why Qt cannot open a window here, or None when it can (or we cannot tell)."""
    if not sys.platform.startswith("linux"):
        return None  # macOS (cocoa) and Windows need neither a DISPLAY nor these libraries
    env = os.environ if env is None else env
    platforms = platforms_to_try(env)
    # (With XDG_SESSION_TYPE=wayland, Qt tries Wayland's default socket even with no WAYLAND_DISPLAY.)
    if not env.get("QT_QPA_PLATFORM") and not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY") \
            and "wayland" not in platforms:
        return (f"{PREFIX}no display: neither DISPLAY nor WAYLAND_DISPLAY is set — start it in a desktop "
                f"session, or over ssh -X {MEANWHILE}")
    with_display = [p for p in platforms if _base(p) != "xcb" or env.get("DISPLAY")]
    if not with_display:
        return f"{PREFIX}QT_QPA_PLATFORM={env['QT_QPA_PLATFORM']} needs DISPLAY, which is not set {MEANWHILE}"
    return _library_problem(with_display, env)


def library_problem(env: Mapping[str, str] | None = None) -> str | None:
    """`window_problem` without the display: are the libraries of the platforms Qt would try (xcb
    where no display is set) all here? For `moescope --check-libraries`, which install.sh runs."""
    if not sys.platform.startswith("linux"):
        return None
    env = os.environ if env is None else env
    return _library_problem(platforms_to_try(env), env)


def _library_problem(platforms: Sequence[str], env: Mapping[str, str]) -> str | None:
    missing_by_platform: dict[str, list[str]] = {}
    for platform in platforms:
        files = plugin_files(platform, env)
        verdicts = [unresolved_libraries(f, env) for f in files]
        if not files or any(v is None or not v for v in verdicts):
            return None  # one of its plugins loads (or Qt knows better than we do)
        missing_by_platform[_base(platform)] = verdicts[-1]  # the one Qt finds by itself
    sonames = list(dict.fromkeys(s for missing in missing_by_platform.values() for s in missing))
    what = "; ".join(f"Qt's {name} platform needs {_and(missing)}" for name, missing in missing_by_platform.items())
    verb = "is" if len(sonames) == 1 else "are"
    return f"{PREFIX}{what}, which {verb} not installed — {install_hint(sonames)} {MEANWHILE}"


def startup_failure_line(platforms: Sequence[str], qt_messages: Sequence[str]) -> str:
    """The one line for a Qt start that failed although `window_problem` saw nothing wrong (a display
    that cannot be reached, a library Qt opens at run time): Qt's own most specific reason, kept short."""
    noise = ("From 6.5.0", "even though it was found", "Could not load the Qt platform plugin")
    reasons = [" ".join(m.split()) for m in qt_messages if m.strip() and not any(n in m for n in noise)]
    names = "/".join(dict.fromkeys(_base(p) for p in platforms)) or "platform"
    if not reasons:  # Qt's fatal text alone ("Reinstalling the application may fix this problem") misleads
        return (f"{PREFIX}Qt could not load its {names} platform plugin; run with QT_DEBUG_PLUGINS=1 to see which "
                f"library it lacks {MEANWHILE}")
    return (f"{PREFIX}Qt could not start its {names} platform ({reasons[-1]}); check DISPLAY/WAYLAND_DISPLAY, "
            f"or run with QT_DEBUG_PLUGINS=1 for Qt's details {MEANWHILE}")
