"""How long one expert-heatmap update takes at 64 layers x 256 experts (the panel's hot path).

Runs offscreen. Each update feeds a new snapshot (new counts, some residency churn) through the
panel exactly as the frame tick does, then paints the widget synchronously (`repaint`), so the
figure includes rasterising, not only the numpy work. Prints the median and the 95th percentile of
the wall-clock time, and of this thread's CPU time (on a shared machine, other processes inflate
the first but not the second).

    python bench/heatmap_bench.py [--layers 64] [--experts 256] [--updates 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from PySide6.QtWidgets import QApplication

from app.models.heatmap import HeatmapData
from app.panels.heatmap import HeatmapPanel
from engine.system.process_settings import apply_process_settings


def main() -> None:
    apply_process_settings()  # before anything computes
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before the QApplication
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--updates", type=int, default=300)
    args = parser.parse_args()

    app = QApplication.instance() or QApplication([])
    panel = HeatmapPanel()
    panel.resize(900, 600)
    panel.show()
    app.processEvents()

    rng = np.random.default_rng(0)
    L, E = args.layers, args.experts
    counts = np.zeros((L, E), dtype=np.int32)
    resident = np.zeros((L, E), dtype=bool)
    resident[:, : E // 4] = True
    frames = []
    for _ in range(args.updates + 20):
        counts += rng.poisson(0.05, size=(L, E)).astype(np.int32)
        # Residency churns a little every update: the outline must be rebuilt each time (worst case).
        flip = rng.integers(0, E, size=L)
        resident[np.arange(L), flip] = ~resident[np.arange(L), flip]
        frames.append(HeatmapData(counts.copy(), resident.copy(), "reply"))

    data_only, with_paint, cpu = [], [], []
    for i, data in enumerate(frames):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        panel.show_data(data)
        t1 = time.perf_counter()
        panel.plot.viewport().repaint()  # synchronous paint of the whole plot: axes, colours, outline
        t2 = time.perf_counter()
        c1 = time.thread_time()
        if i >= 20:  # warm-up
            data_only.append((t1 - t0) * 1e3)
            with_paint.append((t2 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)

    def summary(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.2f} ms, p95 {np.percentile(xs, 95):.2f} ms"

    print(f"heatmap {L} x {E}, {args.updates} updates")
    print(f"  update (arrays -> images):       {summary(data_only)}")
    print(f"  update + synchronous repaint:    {summary(with_paint)}")
    print(f"  the same, this thread's CPU time: {summary(cpu)} (what other processes' load cannot inflate)")
    print(f"median_update_ms={statistics.median(with_paint):.2f}")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of Qt objects (nothing to save; avoids shutdown noise)


if __name__ == "__main__":
    main()
