#!/usr/bin/env bash
# Install MoEScope for the current user, no root needed:
#   the bundle      ~/.local/opt/moescope/            (the PyInstaller folder, started by ./moescope)
#   the command     ~/.local/bin/moescope             (a symlink into the bundle)
#   the menu entry  ~/.local/share/applications/moescope.desktop
#   the icons       ~/.local/share/icons/hicolor/{16x16..512x512,scalable}/apps/moescope.{png,svg}
#   AppStream data  ~/.local/share/metainfo/io.github.moescope.MoEScope.metainfo.xml
# then refreshes the menu and icon caches when update-desktop-database / gtk-update-icon-cache exist,
# and warns (with the apt-get line) when a system library the window needs is missing.
#
#   ./install.sh                  from an unpacked release tarball (MoEScope/ and share/ beside it)
#   packaging/linux/install.sh --bundle dist/MoEScope      from a source checkout after packaging/build.sh
#   ./install.sh --uninstall      removes everything listed above
# --prefix DIR installs under DIR instead of ~/.local (data under DIR/share; default: $XDG_DATA_HOME).
set -euo pipefail

APP=moescope
APP_ID=io.github.moescope.MoEScope

usage() {
    sed -n '2,14s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    echo "usage: install.sh [--bundle DIR] [--prefix DIR] [--uninstall]"
}

say() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=""
bundle=""
mode=install
while [[ $# -gt 0 ]]; do
    case "$1" in
        --uninstall) mode=uninstall ;;
        --bundle) [[ $# -ge 2 ]] || die "--bundle needs a folder"; bundle="$2"; shift ;;
        --bundle=*) bundle="${1#*=}" ;;
        --prefix) [[ $# -ge 2 ]] || die "--prefix needs a folder"; prefix="$2"; shift ;;
        --prefix=*) prefix="${1#*=}" ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
    shift
done

if [[ -n "$prefix" ]]; then
    mkdir -p "$prefix"
    prefix="$(cd "$prefix" && pwd)"
    data_dir="$prefix/share"
else
    [[ -n "${HOME:-}" ]] || die "HOME is not set"
    prefix="$HOME/.local"
    data_dir="${XDG_DATA_HOME:-$HOME/.local/share}"
fi
opt_dir="$prefix/opt/$APP"
bin_link="$prefix/bin/$APP"
desktop_file="$data_dir/applications/$APP.desktop"
metainfo_file="$data_dir/metainfo/$APP_ID.metainfo.xml"
icon_root="$data_dir/icons/hicolor"

refresh_caches() {
    if command -v update-desktop-database >/dev/null 2>&1; then
        update-desktop-database -q "$data_dir/applications" || say "update-desktop-database failed (menu may refresh at next login)"
    fi
    if command -v gtk-update-icon-cache >/dev/null 2>&1 && [[ -d "$icon_root" ]]; then
        gtk-update-icon-cache -q -t -f "$icon_root" || say "gtk-update-icon-cache failed (icons may refresh at next login)"
    fi
}

if [[ "$mode" == uninstall ]]; then
    if [[ -L "$bin_link" && "$(readlink "$bin_link")" == "$opt_dir/$APP" ]]; then
        rm -f "$bin_link"
    fi
    rm -rf "$opt_dir"
    rm -f "$desktop_file" "$metainfo_file"
    rm -f "$icon_root"/*/apps/"$APP".png "$icon_root"/scalable/apps/"$APP".svg
    refresh_caches
    say "removed MoEScope from $prefix (chat history and settings in your home folder are kept)"
    exit 0
fi

# Where the files come from: a release tarball (share/ beside this script) or a source checkout.
if [[ -d "$here/share/applications" ]]; then
    src_desktop="$here/share/applications/$APP.desktop"
    src_metainfo="$here/share/metainfo/$APP_ID.metainfo.xml"
    src_icons="$here/share/icons/hicolor"
    src_svg="$src_icons/scalable/apps/$APP.svg"
    default_bundle="$here/MoEScope"
else
    src_desktop="$here/$APP.desktop"
    src_metainfo="$here/$APP_ID.metainfo.xml"
    src_icons="$here/../icons/hicolor"
    src_svg="$here/../icons/$APP.svg"
    default_bundle="$here/../../dist/MoEScope"
fi
bundle="${bundle:-$default_bundle}"
[[ -x "$bundle/$APP" ]] || die "no bundle at '$bundle' (expected an executable '$bundle/$APP'); build it with packaging/build.sh or pass --bundle DIR"
bundle="$(cd "$bundle" && pwd)"
for f in "$src_desktop" "$src_metainfo" "$src_svg"; do
    [[ -f "$f" ]] || die "missing $f"
done

# The bundle: copied beside the old one, then swapped in, so a failed copy leaves the old install.
[[ "$bundle" != "$opt_dir" ]] || die "the bundle is already installed at $opt_dir"
mkdir -p "$prefix/opt" "$prefix/bin"
rm -rf "$opt_dir.new"
cp -a "$bundle" "$opt_dir.new"
rm -rf "$opt_dir"
mv "$opt_dir.new" "$opt_dir"
ln -sfn "$opt_dir/$APP" "$bin_link"

# The menu entry runs the installed executable by its full path: ~/.local/bin is not on every
# desktop session's PATH. A path with spaces is quoted as the Desktop Entry spec asks.
exec_path="$opt_dir/$APP"
if [[ "$exec_path" == *[[:space:]]* ]]; then
    exec_value="\"$exec_path\""
else
    exec_value="$exec_path"
fi
mkdir -p "$(dirname "$desktop_file")"
while IFS= read -r line || [[ -n "$line" ]]; do
    case "$line" in
        Exec=*) printf 'Exec=%s\n' "$exec_value" ;;
        TryExec=*) printf 'TryExec=%s\n' "$exec_path" ;;
        *) printf '%s\n' "$line" ;;
    esac
done <"$src_desktop" >"$desktop_file"
chmod 644 "$desktop_file"
install -D -m 644 "$src_metainfo" "$metainfo_file"

for png in "$src_icons"/*/apps/"$APP".png; do
    size_dir="$(basename "$(dirname "$(dirname "$png")")")"
    install -D -m 644 "$png" "$icon_root/$size_dir/apps/$APP.png"
done
install -D -m 644 "$src_svg" "$icon_root/scalable/apps/$APP.svg"

refresh_caches
say "installed MoEScope in $opt_dir"
say "menu entry: $desktop_file"
case ":${PATH:-}:" in
    *":$prefix/bin:"*) say "run it from a terminal with: $APP" ;;
    *) say "$prefix/bin is not on your PATH; run $bin_link, or start MoEScope from the applications menu" ;;
esac

# The window needs system libraries the bundle does not carry (Qt's xcb platform: libxcb-cursor0 and
# friends). The bundle checks its own Qt plugin with the code it runs at start-up and names the
# apt-get line; only a warning, since `moescope chat` works without them.
if ! missing="$("$opt_dir/$APP" --check-libraries 2>&1)"; then
    say "warning: ${missing#moescope: }"
fi
