"""Benchmarks: speed and memory, side by side in one run, against baselines and the physical limit."""

import engine  # noqa: F401  (MKL's reproducible mode before its first call, for the stock runs beside ours)
