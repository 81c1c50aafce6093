"""Does live telemetry cost decode speed? Decode tokens/s with snapshots on (10/s) vs off,
through the real worker process, interleaved repetitions, median.

    python -m bench.telemetry_overhead [--model DIR|demo|GEOMETRY] [--reps 5] [--decode 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path

from bench.output import RESULTS_DIR, result_stem
from engine import protocol as p
from engine.process.client import EngineClient
from engine.system.process_settings import apply_process_settings


class _Waiter:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list = []

    def __call__(self, event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait(self, kinds: tuple, timeout: float = 600):
        with self.cond:
            start = len(self.events)
            ok = self.cond.wait_for(lambda: any(isinstance(e, kinds) for e in self.events[start:]), timeout)
            if not ok:
                raise TimeoutError(kinds)
            return next(e for e in self.events[start:] if isinstance(e, kinds))


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry_overhead")
    parser.add_argument("--model", default="qwen3moe-mini")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    model = args.model
    if model != "demo" and not Path(model).is_dir():
        from bench.synthetic import build_checkpoint

        model = str(build_checkpoint(model))
    waiter = _Waiter()
    client = EngineClient(waiter)
    client.start()
    try:
        client.send(p.LoadModel(path=model, budget=args.budget, store="disk"))
        loaded = waiter.wait((p.ModelLoaded, p.Error))
        if isinstance(loaded, p.Error):
            print(loaded.message, file=sys.stderr)
            return 1
        speeds: dict[bool, list[float]] = {True: [], False: []}
        prompt = list(range(3, 131))
        for rep in range(args.reps):
            for enabled in (True, False):  # interleaved, so machine drift hits both alike
                client.send(p.SetTelemetry(enabled=enabled, interval_s=0.1))
                client.send(p.Generate(f"{rep}-{enabled}", prompt_ids=prompt,
                                       sampling=p.SamplingSettings(temperature=0, max_new_tokens=args.decode)))
                done = waiter.wait((p.Done,))
                speeds[enabled].append(done.stats["decode_tokens_per_s"])
        on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
        line = (f"{args.model} at {args.budget}, disk store, {args.decode} decode tokens: decode tokens/s with telemetry "
                f"(10 snapshots/s) {on:.2f}, without {off:.2f}: ratio {on / off:.3f} (median of {args.reps} interleaved; "
                "goal >= 0.98)")
        print(line)
        args.out.mkdir(parents=True, exist_ok=True)
        stem = result_stem("telemetry-overhead")
        (args.out / f"{stem}.md").write_text(line + "\n")
        (args.out / f"{stem}.json").write_text(json.dumps({"model": args.model, "budget": args.budget, "on": speeds[True],
                                                           "off": speeds[False], "ratio": on / off}, indent=1))
    finally:
        client.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
