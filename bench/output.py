"""Where benchmark results go, and how their files are named: `<kind>-<host>-<date>`."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def result_stem(kind: str) -> str:
    """File name stem for one benchmark's results on this machine today."""
    return f"{kind}-{platform.node() or 'host'}-{dt.date.today().isoformat()}"


def write_report(out: Path, kind: str, payload: dict, lines: list[str]) -> None:
    """`<stem>.json` (the payload) and `<stem>.md` (the table lines) under `out`; the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(kind)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
