"""Where benchmark results go, and how their files are named: `<kind>-<host>-<date>`."""

from __future__ import annotations

import datetime as dt
import platform
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def result_stem(kind: str) -> str:
    """File name stem for one benchmark's results on this machine today."""
    return f"{kind}-{platform.node() or 'host'}-{dt.date.today().isoformat()}"
