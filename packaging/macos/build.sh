#!/usr/bin/env bash
# Build MoEScope.app and a .dmg on macOS, from the repository root:
#   packaging/macos/build.sh
# Needs a venv at .venv with torch and `pip install -e ".[gui]"`; uses hdiutil (part of macOS).
# The spec's BUNDLE step writes dist/MoEScope.app with Info.plist keys CFBundleIdentifier
# io.github.moescope.MoEScope, NSHighResolutionCapable (Retina text and plots) and
# NSRequiresAquaSystemAppearance=false (dark mode), and the icon packaging/icons/moescope.icns.
# Not signed: for distribution, sign and notarize it (codesign --deep --options runtime, then
# xcrun notarytool submit); unsigned, users open it the first time with right-click > Open.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
"$python" -c "import PyInstaller" 2>/dev/null || "$python" -m pip install --quiet "pyinstaller>=6.10"
version="$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
"$python" -m PyInstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/moescope.spec
app="dist/MoEScope.app"
[[ -d "$app" ]] || { echo "macos/build.sh: PyInstaller made no $app" >&2; exit 1; }
/usr/libexec/PlistBuddy -c "Print :NSHighResolutionCapable" "$app/Contents/Info.plist"
dmg="dist/MoEScope-$version-macos-$(uname -m).dmg"
rm -f "$dmg"
hdiutil create -volname "MoEScope" -srcfolder "$app" -ov -format UDZO "$dmg"
echo "macos/build.sh: $app ($(du -sh "$app" | cut -f1)), $dmg ($(du -h "$dmg" | cut -f1))"
