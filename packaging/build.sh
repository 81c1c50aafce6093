#!/usr/bin/env bash
# Build the Linux desktop bundle and its release tarball in one command:
#
#   packaging/build.sh [--out DIR] [--no-tarball]
#
#   DIR/MoEScope/                                  the one-folder bundle; DIR/MoEScope/moescope starts it
#   DIR/moescope-VERSION-linux-ARCH.tar.gz          MoEScope/ + share/ (menu entry, icons, metainfo) + install.sh
#
# DIR defaults to dist/ in the checkout (ignored by git); PyInstaller's scratch goes to DIR/.work
# (build/pyinstaller with the default). The Python is $PYTHON, else .venv/bin/python, else python3;
# it needs the project installed (pip install -e ".[gui]") and PyInstaller (installed if missing).
# Prints the bundle's size and the build time.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=""
tarball=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) [[ $# -ge 2 ]] || { echo "build.sh: --out needs a folder" >&2; exit 2; }; out="$2"; shift ;;
        --out=*) out="${1#*=}" ;;
        --no-tarball) tarball=0 ;;
        -h | --help) sed -n '2,13s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "build.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
    shift
done
if [[ -n "$out" ]]; then
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    work="$out/.work"
else
    out="$root/dist"
    work="$root/build/pyinstaller"
fi

if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then
    python="$root/.venv/bin/python"
else
    python="python3"
fi
if ! "$python" -c "import PyInstaller" 2>/dev/null; then
    echo "build.sh: installing PyInstaller into $("$python" -c 'import sys; print(sys.prefix)')"
    "$python" -m pip install --quiet "pyinstaller>=6.10"
fi
"$python" -c "import app.launcher, engine.process.client, resources" \
    || { echo "build.sh: the project is not importable by $python; run: pip install -e \".[gui]\"" >&2; exit 1; }

version="$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$root/pyproject.toml")"
arch="$(uname -m)"
if [[ ! -d "$root/resources/models/demo" ]]; then
    echo "build.sh: warning: resources/models/demo is missing; the bundle will have no demo model" >&2
fi

start=$SECONDS
echo "build.sh: building MoEScope $version into $out/MoEScope (takes minutes)"
(cd "$root" && "$python" -m PyInstaller --noconfirm --log-level WARN \
    --distpath "$out" --workpath "$work" packaging/moescope.spec)
bundle="$out/MoEScope"
[[ -x "$bundle/moescope" ]] || { echo "build.sh: PyInstaller made no $bundle/moescope" >&2; exit 1; }
# Smoke check: the frozen launcher parses its arguments (no window, no engine), and the bundle carries
# the native kernels (one library per instruction-set variant; decode is several times slower without).
"$bundle/moescope" --help >/dev/null
kernels=("$bundle"/_internal/engine/decode/native/lib/*moescope_kernels*)
if [[ -f "$bundle/_internal/engine/decode/native/lib/variants.json" ]]; then
    echo "build.sh: native kernels: ${#kernels[@]} variant(s)"
else
    echo "build.sh: warning: no native kernels bundled (pip install -e . builds them); decode will use transformers' kernels" >&2
fi
build_s=$((SECONDS - start))

if [[ "$tarball" == 1 ]]; then
    name="moescope-$version-linux-$arch"
    stage="$out/$name"
    rm -rf "$stage"
    mkdir -p "$stage/share/applications" "$stage/share/metainfo" "$stage/share/icons/hicolor/scalable/apps"
    cp -al "$bundle" "$stage/MoEScope" 2>/dev/null || cp -a "$bundle" "$stage/MoEScope"  # hard links when possible
    cp "$root/packaging/linux/install.sh" "$stage/install.sh"
    cp "$root/packaging/linux/moescope.desktop" "$stage/share/applications/"
    cp "$root/packaging/linux/io.github.moescope.MoEScope.metainfo.xml" "$stage/share/metainfo/"
    cp -r "$root/packaging/icons/hicolor/." "$stage/share/icons/hicolor/"
    cp "$root/packaging/icons/moescope.svg" "$stage/share/icons/hicolor/scalable/apps/"
    tar -C "$out" -czf "$out/$name.tar.gz" "$name"
    rm -rf "$stage"
    echo "build.sh: tarball $out/$name.tar.gz ($(du -h "$out/$name.tar.gz" | cut -f1))"
fi

echo "build.sh: bundle $bundle ($(du -sh "$bundle" | cut -f1), $(find "$bundle" -type f | wc -l) files)"
echo "build.sh: PyInstaller build took ${build_s} s; total $((SECONDS - start)) s"
