"""Where a decode token's time goes (issue 10): expert matmuls, our bookkeeping, everything else.

Runs the engine at budget `all` (RAM store) on a synthetic geometry, prefills a prompt, then
decodes with a wall-clock split per token:
- experts: the expert matmuls themselves (grouped or per-expert kernels, incl. their gathers) and,
  on the one-token path, the routing-weighted sum of their outputs;
- bookkeeping: the rest of `ExpertCache.run_layer` (routing counts, cache lookups, telemetry
  counters, sorting rows by slot);
- model: everything outside the experts (attention, norms, router, embeddings, LM head, sampling).
With --fast-decode's whole-token step (engine.fused_decode) the native call reports its own split
(norms, qkv_rope, attention, o_proj, router, experts, lm_head), and the bookkeeping is the cache's
record of the token afterwards. Also prints torch.profiler's top operators.

    python -m bench.profile_decode [--geometry qwen3moe-64e] [--decode 32] [--threads 2] [--ops 15]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench.output import RESULTS_DIR, result_stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_decode")
    parser.add_argument("--geometry", default="qwen3moe-64e")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", type=int, default=15, help="top operators to list (0: skip the profiler)")
    parser.add_argument("--fast-decode", action="store_true", help="decode GEMVs skip oneDNN (engine.fast_decode)")
    parser.add_argument("--no-pack-weights", action="store_true", help="expert matrices in plain layout")
    parser.add_argument("--label", default="", help="e.g. before/after: named in the results")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    import torch

    import engine.cache as cache_module
    from bench.measure import prompt_ids
    from bench.synthetic import build_checkpoint
    from engine.generation import Generator
    from engine.runtime import LoadOptions, MoERuntime
    from engine.sampling import SamplingSettings

    torch.set_num_threads(args.threads)
    fast = {"fast_decode": True} if args.fast_decode else {}  # (so the script also profiles older engines)
    if args.no_pack_weights:
        fast["pack_weights"] = False
    runtime = MoERuntime(LoadOptions(model=str(build_checkpoint(args.geometry)), budget="all", store="ram", **fast))
    clock = {"layer": 0.0, "kernels": 0.0, "whole_token_bookkeeping": 0.0}
    run_layer, kernels_grouped, kernels_single = runtime.cache.run_layer, cache_module.grouped_expert_mlp, cache_module.expert_mlp
    kernels_sum = getattr(cache_module, "weighted_sum", None)

    def timed(fn, key):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - start
        return wrapper

    # Instrument for this measurement only (a profiling script, not engine code).
    runtime.cache.run_layer = timed(run_layer, "layer")
    # --fast-decode's whole-token step (engine.fused_decode) does the cache's bookkeeping afterwards
    runtime.cache.record_resident_token = timed(runtime.cache.record_resident_token, "whole_token_bookkeeping")
    cache_module.grouped_expert_mlp = timed(kernels_grouped, "kernels")
    cache_module.expert_mlp = timed(kernels_single, "kernels")
    if kernels_sum is not None:
        cache_module.weighted_sum = timed(kernels_sum, "kernels")
    native = getattr(cache_module, "decode_kernels", None)
    if native is not None and native.ready() is not None:  # --fast-decode's fused experts call
        kernels_native = native.ready()
        functions = {n: getattr(kernels_native, n) for n in dir(kernels_native) if not n.startswith("_")}
        native._kernels = SimpleNamespace(**functions | {"moe_decode": timed(kernels_native.moe_decode, "kernels")})
    ids = prompt_ids(runtime.model.config.get_text_config().vocab_size, args.prompt_len)
    generator = Generator(runtime)
    generator.generate(ids[:8], SamplingSettings(max_new_tokens=4))  # warm-up

    def native_phases() -> dict[str, float]:  # inside the whole-token step, if it runs
        fused = getattr(runtime, "_fused", None)
        return fused.phase_seconds() if fused is not None else {}

    def decode_once() -> tuple[float, dict, dict]:
        marks: list[float] = []
        snapshot: dict = {}
        phases: dict = {}

        def on_token(_token: int) -> None:
            marks.append(time.perf_counter())
            if len(marks) == 1:
                snapshot.update(clock)
                phases.update(native_phases())

        generator.generate(ids, SamplingSettings(max_new_tokens=args.decode), on_token=on_token)
        tokens = len(marks) - 1
        per_token = {k: (clock[k] - snapshot[k]) / tokens for k in clock}
        phase_per_token = {k: (v - phases.get(k, 0.0)) / tokens for k, v in native_phases().items()}
        return (marks[-1] - marks[0]) / tokens, per_token, phase_per_token

    token_s, split, phases = decode_once()
    experts = split["kernels"] + phases.get("experts", 0.0)
    bookkeeping = split["layer"] - split["kernels"] + split["whole_token_bookkeeping"]
    report = {
        "geometry": args.geometry, "threads": args.threads, "fast_decode": args.fast_decode, "decode_tokens_per_s": 1 / token_s,
        "ms_per_token": token_s * 1e3, "experts_ms": experts * 1e3, "bookkeeping_ms": bookkeeping * 1e3,
        "model_ms": (token_s - experts - bookkeeping) * 1e3, "bookkeeping_share": bookkeeping / token_s,
        "label": args.label, "whole_token_step": bool(phases),
        "native_phase_ms": {k: v * 1e3 for k, v in phases.items()},
    }
    print(f"{args.geometry}, {args.threads} threads{', --fast-decode' if args.fast_decode else ''}: "
          f"{report['decode_tokens_per_s']:.1f} tok/s = "
          f"{report['ms_per_token']:.2f} ms/token: experts {report['experts_ms']:.2f} ms, "
          f"bookkeeping {report['bookkeeping_ms']:.2f} ms ({report['bookkeeping_share']:.1%}), "
          f"model {report['model_ms']:.2f} ms", flush=True)
    if phases:
        phase_line = "whole-token native step, per token: " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in report["native_phase_ms"].items())
        print(phase_line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ops:  # torch.profiler over decode steps only: started at the first token, 8 tokens
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU])
        started: list[bool] = []

        def start_at_first_token(_token: int) -> None:
            if not started:
                started.append(True)
                prof.start()

        generator.generate(ids, SamplingSettings(max_new_tokens=9), on_token=start_at_first_token)
        prof.stop()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops)
        print(table)
        mode = "fast-decode" if args.fast_decode else "default"
        label = f"-{args.label}" if args.label else ""
        (args.out / f"{result_stem('profile-decode')}-{args.geometry}-{mode}{label}.txt").write_text(
            f"{args.geometry}, {args.threads} threads, {mode}{' (' + args.label + ')' if args.label else ''}: "
            f"8 decode tokens after a {args.prompt_len}-token prompt, torch.profiler, by self CPU time\n"
            f"split per token: {report['ms_per_token']:.2f} ms = experts {report['experts_ms']:.2f} + bookkeeping "
            f"{report['bookkeeping_ms']:.2f} ({report['bookkeeping_share']:.1%}) + model {report['model_ms']:.2f}\n"
            + (phase_line + " (torch.profiler below sees this step as one call)\n" if phases else "") + "\n"
            + table + "\n")
    print(json.dumps(report))
    target = args.out / f"{result_stem('profile-decode')}.jsonl"
    with target.open("a") as results:  # one line per run: before/after profiles side by side
        results.write(json.dumps(report) + "\n")
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
