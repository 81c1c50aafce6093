"""Benchmarks: speed and memory, side by side in one run, against baselines and the physical limit."""
