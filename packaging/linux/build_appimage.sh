#!/usr/bin/env bash
# AppImage recipe: wrap the PyInstaller bundle into MoEScope-VERSION-ARCH.AppImage.
#
#   packaging/linux/build_appimage.sh [--bundle dist/MoEScope] [--out dist]
#
# Lays out DIR/MoEScope.AppDir (AppRun, the .desktop entry, the icon, metainfo, the bundle under
# usr/lib/moescope) and runs appimagetool on it. appimagetool (and the AppImage runtime it embeds)
# is not in PyPI, npm or Debian's archive, so on a machine without it the script stops after the
# AppDir and says so; run `appimagetool DIR/MoEScope.AppDir` where it is installed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bundle="$root/dist/MoEScope"
out="$root/dist"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --bundle) bundle="$2"; shift ;;
        --out) out="$2"; shift ;;
        -h | --help) sed -n '2,9s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "build_appimage.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
    shift
done
[[ -x "$bundle/moescope" ]] || { echo "build_appimage.sh: no bundle at $bundle; run packaging/build.sh first" >&2; exit 1; }
mkdir -p "$out"

version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -n 1)"
arch="$(uname -m)"
appdir="$out/MoEScope.AppDir"
rm -rf "$appdir"
mkdir -p "$appdir/usr/lib" "$appdir/usr/share/applications" "$appdir/usr/share/metainfo"
cp -a "$bundle" "$appdir/usr/lib/moescope"

cat >"$appdir/AppRun" <<'EOF'
#!/bin/sh
# The AppImage's entry: run the bundled executable with the user's arguments.
here="$(dirname "$(readlink -f "$0")")"
exec "$here/usr/lib/moescope/moescope" "$@"
EOF
chmod 755 "$appdir/AppRun"

cp "$here/moescope.desktop" "$appdir/moescope.desktop"
cp "$here/moescope.desktop" "$appdir/usr/share/applications/moescope.desktop"
# appimagetool looks for the metainfo under the desktop id's name.
cp "$here/io.github.moescope.MoEScope.metainfo.xml" "$appdir/usr/share/metainfo/moescope.appdata.xml"
cp "$root/packaging/icons/hicolor/256x256/apps/moescope.png" "$appdir/moescope.png"
ln -s moescope.png "$appdir/.DirIcon"
mkdir -p "$appdir/usr/share/icons"
cp -r "$root/packaging/icons/hicolor" "$appdir/usr/share/icons/"

target="$out/MoEScope-$version-$arch.AppImage"
if command -v appimagetool >/dev/null 2>&1; then
    ARCH="$arch" appimagetool --no-appstream "$appdir" "$target"
    echo "build_appimage.sh: $target ($(du -h "$target" | cut -f1))"
else
    echo "build_appimage.sh: AppDir ready at $appdir; appimagetool is not installed, so no AppImage was made." >&2
    echo "build_appimage.sh: on a machine with appimagetool: ARCH=$arch appimagetool $appdir $target" >&2
    exit 3
fi
