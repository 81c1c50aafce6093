"""One measurement per process, so each system's peak memory is its own.

    python -m bench.measure ours --model DIR --budget 25% --prompt-len 128 --decode 64 [--routing random|trace|olmoe]
    python -m bench.measure stock --model DIR --prompt-len 128 --decode 64
    python -m bench.measure accelerate --model DIR --max-memory-bytes N --prompt-len 128 --decode 64

Prints one JSON object. Prompts are seeded random token ids: speed does not depend on meaning.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from engine.system.process_settings import apply_process_settings


def prompt_ids(vocab: int, length: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=length).tolist()


def peak_rss() -> int:
    from engine.system.memory import peak_rss_bytes

    return peak_rss_bytes()


def peak_gpu() -> dict:
    """The GPU memory torch's allocator held at its peak, where this process used a GPU."""
    import torch

    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated()} if torch.cuda.is_initialized() else {}


def measure_ours(args) -> dict:
    import torch

    from bench.format_settings import load_settings
    from bench.routing import bench_cache, olmoe_choices, synthetic_locality_trace
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.model.inspect import inspect_checkpoint
    from engine.protocol import LoadModel, SamplingSettings

    torch.set_num_threads(args.threads)
    trace = None
    if args.routing != "random":
        info = inspect_checkpoint(args.model)
        if args.routing == "olmoe":  # real routing, cycled past its 299 tokens
            trace = olmoe_choices(info.num_moe_layers, info.num_experts, info.top_k)
        else:
            trace = synthetic_locality_trace(args.prompt_len + args.decode + 8, info.num_moe_layers, info.num_experts,
                                             info.top_k, seed=args.seed)
    format_settings = load_settings(args.format) if args.format else {}  # None: the checkpoint's own weights
    cache_type = bench_cache(choices=trace, forget=args.no_cache)  # no cache: baseline (c), every expert on demand
    runtime = MoERuntime(LoadModel(path=args.model, budget=args.budget, store=args.store, device=args.device,
                                   policy=args.policy, warm=not args.no_cache, fast_decode=args.fast_decode,
                                   int8_inputs=args.int8_inputs,
                                   pack_weights=not args.no_pack_weights, **format_settings),
                         cache_type=cache_type)
    layout = runtime.layout
    ids = prompt_ids(runtime.model.config.get_text_config().vocab_size, args.prompt_len, args.seed)
    generator = Generator(runtime)
    generator.generate(ids[:8], SamplingSettings(temperature=0, max_new_tokens=2))  # warm-up, as for the baselines
    if args.trace_out:
        runtime.start_trace(args.trace_out)  # the routing this run saw, for Belady's bound
    with bandwidth_around(args) as bandwidth:
        result = generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=args.decode))
    runtime.stop_trace()
    routing_rows_used = runtime.cache.routing.position[0] if trace is not None else None  # warm-up included
    s = result.stats
    decode_time = (s.decode_tokens - 1) / s.decode_tokens_per_s if s.decode_tokens_per_s else 0.0
    runtime.close()
    return {
        "system": "moescope-nocache" if args.no_cache else "moescope",
        "budget_bytes": s.budget_bytes,
        "expert_bytes": layout.all_expert_bytes,
        "slot_bytes": layout.slot_bytes,
        "slots_per_layer": runtime.cache.slots_per_layer,
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "ttft_s": s.ttft_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "hit_rate": s.hit_rate,
        "decode_hit_rate": s.decode_hit_rate,
        "bytes_per_token": s.bytes_loaded / max(1, s.prefill_tokens + s.decode_tokens),
        "stall_share": s.stall_s / s.total_s if s.total_s else 0.0,
        "decode_s": decode_time,
        "total_s": s.total_s,
        "bytes_loaded": s.bytes_loaded,
        "decode_bytes_per_token": s.decode_bytes_loaded / max(1, s.decode_tokens - 1),
        "loads_per_token": s.bytes_loaded / layout.slot_bytes / max(1, s.prefill_tokens + s.decode_tokens),
        "decode_loads_per_token": s.decode_bytes_loaded / layout.slot_bytes / max(1, s.decode_tokens - 1),
        "routing_rows": None if trace is None else len(trace),  # a shorter trace is cycled
        "routing_rows_used": routing_rows_used,
        "dense_bytes": layout.dense_bytes,
        "peak_rss_bytes": peak_rss(),
        **peak_gpu(),
        "token_ids": result.token_ids,
        **bandwidth,
    }


@contextmanager
def bandwidth_around(args):
    """With --bandwidth: the memory read bandwidth measured in this process just before and just
    after the timed run (keys bandwidth_before / bandwidth_after in the yielded dict, filled on
    exit). The VM this was built on switches between bandwidth levels for seconds at a time, so
    a limit measured minutes apart could belong to another level than the run it is set against."""
    measured: dict[str, float] = {}
    if not args.bandwidth:
        yield measured
        return
    from bench.bandwidth import memory_read_bandwidth

    measured["bandwidth_before"] = memory_read_bandwidth(threads=args.threads)
    yield measured
    measured["bandwidth_after"] = memory_read_bandwidth(threads=args.threads)


class _TokenClock:
    """A generate() streamer that timestamps tokens: the first put() is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate_timed(model, ids: list[int], decode: int) -> dict:
    import torch

    input_ids = torch.tensor([ids], device=model.device)
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        sequences = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=decode, min_new_tokens=decode, streamer=clock, pad_token_id=0)
    first, last = clock.times[1], clock.times[-1]
    return {
        "prefill_tokens_per_s": len(ids) / (first - start),
        "ttft_s": first - start,
        "decode_tokens_per_s": (decode - 1) / (last - first) if decode > 1 else 0.0,
        "decode_s": last - first,
        "token_ids": sequences[0, len(ids):].tolist(),
    }


def measure_stock(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", experts_implementation=args.impl)
    model.to(args.device)
    ids = prompt_ids(model.config.get_text_config().vocab_size, args.prompt_len, args.seed)
    _generate_timed(model, ids[:8], 2)  # warm-up: first-call costs are not decode speed
    with bandwidth_around(args) as bandwidth:
        out = _generate_timed(model, ids, args.decode)
    return {"system": f"transformers ({args.impl})", **out, "peak_rss_bytes": peak_rss(), **peak_gpu(), **bandwidth}


def measure_accelerate(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    # On a GPU, accelerate keeps what fits in max_memory there and the rest in RAM; on a CPU, the
    # rest goes to the offload folder on disk.
    max_memory = ({0: args.max_memory_bytes, "cpu": 1 << 40} if args.device == "cuda"
                  else {"cpu": args.max_memory_bytes})
    with tempfile.TemporaryDirectory(prefix="moescope-offload-") as offload:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype="auto", device_map="auto", max_memory=max_memory,
            offload_folder=offload, experts_implementation=args.impl,
        )
        ids = prompt_ids(model.config.get_text_config().vocab_size, args.prompt_len, args.seed)
        out = _generate_timed(model, ids, args.decode)
    return {"system": "transformers + accelerate offload", **out, "max_memory_bytes": args.max_memory_bytes,
            "peak_rss_bytes": peak_rss(), **peak_gpu()}


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.measure")
    parser.add_argument("system", choices=["ours", "stock", "accelerate"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--budget", default="all")
    parser.add_argument("--store", default="disk")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="ours: where the cache lives; stock: where the model runs; accelerate: the device it fills first")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--no-pack-weights", action="store_true", help="ours: expert matrices in plain layout")
    parser.add_argument("--fast-decode", action="store_true", help="ours: decode GEMVs skip oneDNN (engine.decode.paths.native_layers)")
    parser.add_argument("--int8-inputs", action="store_true", help="ours: the opt-in lossy 8-bit inputs (llama.cpp's precision)")
    parser.add_argument("--format", default=None, help="ours: a weight format of bench.format_settings (bf16, ...)")
    parser.add_argument("--routing", default="random", choices=["random", "trace", "olmoe"],
                        help="the model's own router (random weights), a synthetic trace with locality, or the real "
                        "OLMoE-1B-7B routing (bench.routing.OLMOE_TRACE; qwen3moe-64e's geometry), cycled")
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--impl", default="grouped_mm")
    parser.add_argument("--max-memory-bytes", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bandwidth", action="store_true",
                        help="also measure the memory read bandwidth just before and after the timed run")
    parser.add_argument("--trace-out", default=None, help="record this run's routing (ours only)")
    args = parser.parse_args(argv)
    fn = {"ours": measure_ours, "stock": measure_stock, "accelerate": measure_accelerate}[args.system]
    print(json.dumps(fn(args)))
    return 0


if __name__ == "__main__":
    from engine.system.process_exit import exit_process

    exit_process(main())
