"""Render the application icon for every desktop: PNGs for Linux, .ico for Windows, .icns for macOS.

    python packaging/icons/render_icons.py [--out packaging/icons]

Everything comes from packaging/icons/moescope.svg, drawn by Qt's SVG renderer offscreen (no X
server, no Pillow). The .ico and .icns containers are written here by hand: both simply hold PNG
images (an .ico with PNG entries is read by Windows Vista and later; an .icns with `ic07`..`ic14`
PNG entries by macOS 10.7 and later), so no image library is needed to build them. The outputs are
committed, so a build does not need to run this; run it again after editing the SVG.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SVG = HERE / "moescope.svg"
NAME = "moescope"
PNG_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)  # hicolor sizes shipped for Linux
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)  # 256 is the largest an .ico entry can declare
# .icns entry types holding PNG data, by pixel size (the @2x types share a size with a 1x one).
ICNS_TYPES = (
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256), (b"ic09", 512),
    (b"ic10", 1024), (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512),
)


def render_png(svg: Path, size: int) -> bytes:
    """The SVG drawn at size x size pixels, as PNG bytes (needs a QGuiApplication)."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"render_icons: cannot read {svg}")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(0)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.convertToFormat(QImage.Format.Format_ARGB32).save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def build_ico(pngs: dict[int, bytes]) -> bytes:
    """An .ico file whose entries are PNG images (ICONDIR + ICONDIRENTRY records + the images)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))
    offset = len(header) + 16 * len(sizes)
    entries, images = b"", b""
    for size in sizes:
        data = pngs[size]
        dim = 0 if size >= 256 else size  # 0 means 256 in the directory entry
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        images += data
        offset += len(data)
    return header + entries + images


def build_icns(pngs: dict[int, bytes]) -> bytes:
    """An .icns file with PNG entries for every standard size, 16 to 1024 (512@2x)."""
    body = b"".join(kind + struct.pack(">I", 8 + len(pngs[size])) + pngs[size] for kind, size in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--svg", type=Path, default=SVG)
    parser.add_argument("--out", type=Path, default=HERE, help="folder for hicolor/, moescope.ico, moescope.icns")
    args = parser.parse_args(argv)

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 (keeps Qt's GUI state alive)
    sizes = sorted({*PNG_SIZES, *ICO_SIZES, *(size for _, size in ICNS_TYPES)})
    pngs = {size: render_png(args.svg, size) for size in sizes}

    for size in PNG_SIZES:
        target = args.out / "hicolor" / f"{size}x{size}" / "apps" / f"{NAME}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pngs[size])
    (args.out / f"{NAME}.ico").write_bytes(build_ico({size: pngs[size] for size in ICO_SIZES}))
    (args.out / f"{NAME}.icns").write_bytes(build_icns(pngs))
    print(f"render_icons: {len(PNG_SIZES)} PNGs, {NAME}.ico, {NAME}.icns in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
