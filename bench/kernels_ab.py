"""Two builds of the native kernels in one process, taking turns on the same weights.

Separate processes run at whatever memory bandwidth the host gives at that moment (on the 2-core VM
it jumps between two levels for seconds at a time), which hides a few percent either way. Here one
model is loaded once and its decode tokens alternate between two kernel builds: the whole-token
step made once with each (same weights, same KV cache contents, same prompt), tokens timed in
blocks that switch build every block. Also a prompt's experts (`moe_prompt`) on each build.

The other build is any object with the kernels' calls: another variant of this install
(`--other-variant x86-64-v3`), or an older checkout's torch-extension build loaded by path
(`--other-module path/to/moescope_decode_*.so`: what the kernels were before they were prebuilt), or
a library of this ABI built by hand with other flags (`--other-library path.so`).

    python -m bench.kernels_ab --geometry qwen3moe-64e [--format q4_k] --other-module OLD.so
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from bench.measure import prompt_ids
from bench.output import RESULTS_DIR, write_report
from bench.synthetic import build_checkpoint
from engine.system.process_settings import apply_process_settings


def load_other(args):
    """The other build: a variant of this install, or an extension module loaded from a file."""
    import torch  # noqa: F401  (a torch extension needs torch loaded first)

    from engine.decode.native import library

    if args.other_variant:
        chosen = next(v for v in library.variants() if v.name == args.other_variant)
        return library.Kernels(library.LIB_DIR / chosen.file, chosen), f"variant {chosen.name}"
    if args.other_library:  # a library built by hand, e.g. with other flags
        return library.Kernels(Path(args.other_library)), f"library {args.other_library}"
    path = Path(args.other_module)
    loader = importlib.machinery.ExtensionFileLoader(path.name.split(".")[0], str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module, f"module {path.name}"


def _forget_weights(model) -> None:
    """Each build makes its own weight handles: drop the ones cached on the modules."""
    for module in model.modules():
        module.__dict__.pop("_moescope_weight", None)


def decode_blocks(runtime, decoders: dict, ids: list[int], tokens: int, block: int) -> dict[str, list[float]]:
    """Seconds per token of each decoder, in blocks of `block` tokens taking turns, from one prompt."""
    import torch

    from engine.decode.kv_cache import new_cache
    from engine.decode.paths.transformers_path import last_position
    from engine.model.cache_argument import cache_argument

    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    kv = {}
    with torch.inference_mode():
        for name in decoders:  # one prompt each: same KV cache contents
            kv[name] = new_cache(runtime.model)
            x = torch.tensor([ids])
            out = runtime.model(input_ids=x, **cache_argument(runtime.model, kv[name]), use_cache=True,
                                logits_to_keep=last_position(x))
            kv[name].next_token = int(out.logits[0, -1].argmax())
        for start in range(0, tokens, block):
            order = list(decoders) if (start // block) % 2 == 0 else list(decoders)[::-1]
            for name in order:
                began = time.perf_counter()
                for _ in range(block):
                    logits = decoders[name].step(kv[name].next_token, kv[name])
                    kv[name].next_token = int(logits[0, -1].argmax())
                seconds[name].append((time.perf_counter() - began) / block)
    return seconds


def prompt_blocks(kernels: dict, geometry_dims: tuple[int, int], fmt, turns: int) -> dict[str, list[float]]:
    """Seconds of one layer's experts over a 128-token prompt (top-8 of 64 experts' rows), each build in turn."""
    import torch

    from engine.decode.native import kernels as native
    from engine.formats.quantize import quantize

    hidden, inter = geometry_dims
    generator = torch.Generator().manual_seed(3)
    experts = 16
    counts = [128 * 8 // experts] * experts
    start = [sum(counts[:e]) for e in range(experts)]
    x = (torch.randn(sum(counts), hidden, generator=generator) * 0.5).to(torch.bfloat16)

    def matrix(rows: int, cols: int):
        w = torch.randn(rows, cols, generator=generator) * 0.02
        if fmt is None:
            plain = w.to(torch.bfloat16)
            return lambda k: native.weight(k, plain)
        packed = torch.from_numpy(quantize(w.numpy(), fmt))
        return lambda k: native.weight(k, packed, fmt, cols)

    gate_up = [matrix(2 * inter, hidden) for _ in range(experts)]
    down = [matrix(hidden, inter) for _ in range(experts)]
    made = {name: ([g(k) for g in gate_up], [d(k) for d in down]) for name, k in kernels.items()}
    seconds: dict[str, list[float]] = {name: [] for name in kernels}
    for turn in range(turns):
        order = list(kernels) if turn % 2 == 0 else list(kernels)[::-1]
        for name in order:
            began = time.perf_counter()
            kernels[name].moe_prompt(x, start, counts, *made[name])
            seconds[name].append(time.perf_counter() - began)
    return seconds


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    import torch

    from engine.decode.modules.whole_token_step import WholeTokenStep
    from engine.decode.native import kernels as native
    from engine.decode.runtime import MoERuntime
    from engine.formats.blocks import parse_format
    from engine.protocol import LoadModel

    parser = argparse.ArgumentParser(prog="python -m bench.kernels_ab")
    parser.add_argument("--geometry", default="qwen3moe-64e")
    parser.add_argument("--format", default=None, help="the experts' weight format (q4_k, q8_0, ...); bf16 without")
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--other-variant")
    other.add_argument("--other-module")
    other.add_argument("--other-library")
    parser.add_argument("--this-library", help="a library of this ABI built by hand, instead of the variant this CPU runs")
    parser.add_argument("--prompt-len", type=int, default=128, help="longer prompts weigh attention more")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--prompt-turns", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = build_checkpoint(args.geometry)
    runtime = MoERuntime(LoadModel(path=str(path), budget="all", store="ram", expert_format=args.format or "original"))
    ours = native.load()
    if args.this_library:
        from engine.decode.native import library

        ours = library.Kernels(Path(args.this_library))
    theirs, theirs_name = load_other(args)
    builds = {"this": ours, "other": theirs}
    decoders = {}
    for name, kernels in builds.items():
        _forget_weights(runtime.model)
        decoders[name] = WholeTokenStep(runtime.model, runtime.cache, kernels)
    _forget_weights(runtime.model)
    ids = prompt_ids(runtime.model.config.get_text_config().vocab_size, args.prompt_len)
    decode = decode_blocks(runtime, decoders, ids, args.tokens, args.block)
    phases = {name: decoder.phase_seconds() for name, decoder in decoders.items()}  # where each build's time went
    config = runtime.model.config.get_text_config()
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    prompt = prompt_blocks(builds, (config.hidden_size, inter), parse_format(args.format), args.prompt_turns)
    runtime.close()
    decode_ratio = statistics.median(o / t for t, o in zip(decode["this"], decode["other"], strict=True))
    prompt_ratio = statistics.median(o / t for t, o in zip(prompt["this"], prompt["other"], strict=True))
    row = {"geometry": args.geometry, "format": args.format or "bf16", "this": f"variant {ours.variant.name}",
           "other": theirs_name, "decode_tokens_per_s_this": 1 / statistics.median(decode["this"]),
           "decode_tokens_per_s_other": 1 / statistics.median(decode["other"]), "decode_this_over_other": decode_ratio,
           "prompt_experts_this_over_other": prompt_ratio, "decode_seconds": decode, "prompt_seconds": prompt,
           "phase_seconds": phases}
    lines = [
        f"The native kernels, this build ({row['this']}) against another ({theirs_name}), in one process on the same "
        f"weights — {args.threads} threads, budget all, {args.geometry} {row['format']}: whole-token decode after a "
        f"{args.prompt_len}-token prompt, {args.tokens} tokens per build in blocks of {args.block} taking turns; a layer's "
        f"experts over a 128-token prompt (moe_prompt), {args.prompt_turns} turns each. Ratios: median of the "
        "blocks' (turns') speed ratios, this / other.",
        "",
        "| geometry | format | decode tok/s, this / other | decode, this / other | prompt experts, this / other |",
        "|---|---|---|---|---|",
        f"| {args.geometry} | {row['format']} | {row['decode_tokens_per_s_this']:.1f} / "
        f"{row['decode_tokens_per_s_other']:.1f} | {decode_ratio:.3f} | {prompt_ratio:.3f} |",
        "",
        "Decode time by part (seconds over all tokens), this / other: " + ", ".join(
            f"{part} {phases['this'][part]:.3f} / {phases['other'][part]:.3f}" for part in phases["this"]),
    ]
    write_report(args.out, f"kernels-ab-{args.label}" if args.label else "kernels-ab", row, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
