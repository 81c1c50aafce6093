"""Where a decode token's time goes (issue 10): expert matmuls, our bookkeeping, everything else.

Runs the engine at budget `all` (RAM store) on a synthetic geometry, prefills a prompt, then
decodes with a wall-clock split per token:
- experts: the expert matmuls themselves (grouped or per-expert kernels, incl. their gathers) and,
  on the one-token path, the routing-weighted sum of their outputs;
- bookkeeping: the rest of `ExpertCache.run_layer` (routing counts, cache lookups, telemetry
  counters, sorting rows by slot), and the policy's end of token (where `markov` learns a token);
- model: everything outside the experts (attention, norms, router, embeddings, LM head, sampling).
With --fast-decode's whole-token step (engine.decode.modules.whole_token_step) the native call reports its own split
(norms, qkv_rope, attention, o_proj, router, experts, lm_head), and the bookkeeping is the cache's
record of the token afterwards. Also prints torch.profiler's top operators.

    python -m bench.profile_decode [--geometry qwen3moe-64e | --model PATH] [--decode 32] [--threads 2] [--ops 15] [--policy lru]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.output import RESULTS_DIR, result_stem
from engine.system.process_settings import apply_process_settings


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.profile_decode")
    parser.add_argument("--geometry", default="qwen3moe-64e")
    parser.add_argument("--model", default="", help="a checkpoint folder or GGUF file instead of --geometry")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", type=int, default=15, help="top operators to list (0: skip the profiler)")
    parser.add_argument("--fast-decode", action="store_true", help="decode GEMVs skip oneDNN (engine.decode.paths.native_layers)")
    parser.add_argument("--no-pack-weights", action="store_true", help="expert matrices in plain layout")
    parser.add_argument("--policy", default="lru", help="cache policy (its bookkeeping is counted)")
    parser.add_argument("--format", default=None, help="a weight format of bench.format_settings (q4_k, q8_0, ...)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the split is host time (a GPU token is bound by its launches); the profile adds the GPU's")
    parser.add_argument("--label", default="", help="e.g. before/after: named in the results")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    import torch

    import engine.offload.expert_cache as cache_module
    from bench.format_settings import load_settings
    from bench.measure import prompt_ids
    from bench.synthetic import build_checkpoint
    from engine.decode.generation import Generator
    from engine.decode.modules import native_experts
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    torch.set_num_threads(args.threads)
    model = args.model or str(build_checkpoint(args.geometry))
    name = Path(args.model).name if args.model else args.geometry
    runtime = MoERuntime(LoadModel(path=model, budget="all", store="ram", device=args.device,
                                   fast_decode=args.fast_decode, pack_weights=not args.no_pack_weights,
                                   policy=args.policy, **(load_settings(args.format) if args.format else {})))
    clock = {"layer": 0.0, "kernels": 0.0, "whole_token_bookkeeping": 0.0, "policy_token_end": 0.0}
    in_layer: list[bool] = []

    def timed(fn, key):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - start
        return wrapper

    # Instrument for this measurement only (a profiling script, not engine code).
    run_layer, record = runtime.cache.run_layer, runtime.cache.record

    def layer(*a, **kw):
        in_layer.append(True)
        try:
            return timed(run_layer, "layer")(*a, **kw)
        finally:
            in_layer.pop()

    def record_step(step):  # the whole-token path records a token outside any layer
        return record(step) if in_layer else timed(record, "whole_token_bookkeeping")(step)

    runtime.cache.run_layer, runtime.cache.record = layer, record_step
    policy = runtime.cache.policy
    policy.on_token_end = timed(policy.on_token_end, "policy_token_end")
    cache_module.grouped_expert_mlp = timed(cache_module.grouped_expert_mlp, "kernels")
    cache_module.expert_mlp = timed(cache_module.expert_mlp, "kernels")
    runtime.cache._one_token = timed(runtime.cache._one_token, "kernels")  # the exact one-token path
    native_experts.NativeExperts.__call__ = timed(native_experts.NativeExperts.__call__, "kernels")
    ids = prompt_ids(runtime.model.config.get_text_config().vocab_size, args.prompt_len)
    generator = Generator(runtime)
    generator.generate(ids[:8], SamplingSettings(temperature=0, max_new_tokens=4))  # warm-up

    def native_phases() -> dict[str, float]:  # inside the whole-token step, if it runs
        decoder = runtime.whole_token._decoder
        return decoder.phase_seconds() if decoder is not None else {}

    def decode_once() -> tuple[float, dict, dict]:
        marks: list[float] = []
        snapshot: dict = {}
        phases: dict = {}

        def on_token(_token: int) -> None:
            marks.append(time.perf_counter())
            if len(marks) == 1:
                snapshot.update(clock)
                phases.update(native_phases())

        generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=args.decode), on_token=on_token)
        tokens = len(marks) - 1
        per_token = {k: (clock[k] - snapshot[k]) / tokens for k in clock}
        phase_per_token = {k: (v - phases.get(k, 0.0)) / tokens for k, v in native_phases().items()}
        return (marks[-1] - marks[0]) / tokens, per_token, phase_per_token

    token_s, split, phases = decode_once()
    experts = split["kernels"] + phases.get("experts", 0.0)
    bookkeeping = split["layer"] - split["kernels"] + split["whole_token_bookkeeping"] + split["policy_token_end"]
    report = {
        "geometry": name, "device": args.device, "threads": args.threads, "fast_decode": args.fast_decode, "decode_tokens_per_s": 1 / token_s,
        "ms_per_token": token_s * 1e3, "experts_ms": experts * 1e3, "bookkeeping_ms": bookkeeping * 1e3,
        "model_ms": (token_s - experts - bookkeeping) * 1e3, "bookkeeping_share": bookkeeping / token_s,
        "label": args.label, "policy": args.policy, "format": args.format or "checkpoint", "whole_token_step": bool(phases),
        "native_phase_ms": {k: v * 1e3 for k, v in phases.items()},
    }
    print(f"{name}, {args.device}, {args.threads} threads{', --fast-decode' if args.fast_decode else ''}: "
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

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        prof = profile(activities=activities)
        started: list[bool] = []

        def start_at_first_token(_token: int) -> None:
            if not started:
                started.append(True)
                prof.start()

        generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=9), on_token=start_at_first_token)
        prof.stop()
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=args.ops)
        if args.device == "cuda":
            launches = sum(e.count for e in averages if e.key.startswith("cudaLaunchKernel"))
            table += f"\nkernel launches per decode token: {launches / 8:.0f}\n"
        print(table)
        mode = ("fast-decode" if args.fast_decode else "default") + ("-cuda" if args.device == "cuda" else "")
        label = f"-{args.label}" if args.label else ""
        (args.out / f"{result_stem('profile-decode')}-{Path(name).stem}-{mode}{label}.txt").write_text(
            f"{name}, {args.threads} threads, {mode}{' (' + args.label + ')' if args.label else ''}: "
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
