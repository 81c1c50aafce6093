"""Decode speed of each weight format the window's picker offers, side by side in one process.

One runtime per format is loaded at budget `all` (the model's own dtype, as the window loads it;
conversions are cached, so only the first run converts). Then the formats take turns: each round
runs one greedy reply of `--decode` tokens from the same prompt on every format, in an order that
rotates every round, so that a slow moment of the host falls on every format alike. A format's
figure is the median of its rounds' decode rates; its ratio is the median of its per-round rates
over the original format's rate in the same round.

Formats are the picker's names for the experts (`q4_k`, the dense weights as shipped) or
`dense:<name>` (the dense weights in that format, the experts as shipped). A name ending in
`@torch` expands quantized slots with the torch reference dequantizer instead of the native one
(what a float32 model such as the demo did before the native expansion took float32 too).

    python -m bench.format_speed --model demo
    python -m bench.format_speed --geometry qwen3moe-64e --formats original,q8_0,q4_k,q3_k,q2_k
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.measure import prompt_ids
from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

PICKER_FORMATS = "original,q8_0,q6_k,q4_k,q3_k,q2_k"


def load_fields(name: str) -> dict:
    """The `LoadModel` fields of one benchmark format name."""
    name = name.removesuffix("@torch")
    if name == "original":
        return {}
    if name.startswith("dense:"):
        return {"dense_format": name.removeprefix("dense:")}
    return {"expert_format": name}


def model_path(args) -> str:
    if args.geometry is None:
        return args.model
    from bench.synthetic import build_checkpoint

    return str(build_checkpoint(args.geometry))


def decode_rate(generator, ids: list[int], tokens: int) -> tuple[float, int]:
    """(decode tokens a second, tokens decoded) of one greedy reply from `ids`."""
    from engine.protocol import SamplingSettings

    result = generator.generate(ids, SamplingSettings(temperature=0, max_new_tokens=tokens))
    return result.stats.decode_tokens_per_s, result.stats.decode_tokens


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="a model as --model takes it (default: the demo)")
    parser.add_argument("--geometry", help="a synthetic bench geometry (bench.synthetic) instead of --model")
    parser.add_argument("--formats", default=PICKER_FORMATS)
    parser.add_argument("--decode", type=int, default=48, help="tokens per reply")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exact", action="store_true", help="transformers' kernels (--exact) instead of the native ones")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="appended to the results' name")
    return parser.parse_args(argv)


def load_runtimes(path: str, names: list[str], exact: bool) -> dict:
    """One runtime per format name, at budget all."""
    from engine.decode.runtime import MoERuntime
    from engine.formats.dequantize import reference_dequantizer
    from engine.protocol import LoadModel

    runtimes = {}
    for name in names:
        print(f"loading {name}…", file=sys.stderr, flush=True)
        runtime = MoERuntime(LoadModel(path=path, budget="all", fast_decode=not exact, **load_fields(name)))
        if name.endswith("@torch"):
            runtime.cache.use_dequantizer(reference_dequantizer)
        runtimes[name] = runtime
    return runtimes


def timed_rounds(runtimes: dict, ids: list[int], decode: int, rounds: int) -> tuple[dict, dict]:
    """Each round, one reply on every format, starting one format later than the round before:
    (decode rates by format, one per round; tokens decoded by format)."""
    from engine.decode.generation import Generator

    names = list(runtimes)
    generators = {name: Generator(runtime) for name, runtime in runtimes.items()}
    for generator in generators.values():
        decode_rate(generator, ids, 4)  # warm-up: first-use setup out of the timed rounds
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, int] = {}
    for turn in range(rounds):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            rate, tokens[name] = decode_rate(generators[name], ids, decode)
            rates[name].append(rate)
    return rates, tokens


def main(argv=None) -> int:
    apply_process_settings()  # before anything computes
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    runtimes = load_runtimes(model_path(args), names, args.exact)
    vocab = next(iter(runtimes.values())).model.config.get_text_config().vocab_size
    rates, tokens = timed_rounds(runtimes, prompt_ids(vocab, args.prompt_len), args.decode, args.rounds)
    paths = {name: runtime.decode_path for name, runtime in runtimes.items()}
    for runtime in runtimes.values():
        runtime.close()

    base, over = rates[names[0]], f"over_{names[0]}"
    rows = [{"format": name, "decode_tokens_per_s": statistics.median(rates[name]),
             over: statistics.median(r / b for r, b in zip(rates[name], base, strict=True)),
             "decode_tokens": tokens[name], "decode_path": paths[name], "rates": rates[name]} for name in names]
    label = args.geometry or Path(args.model).name
    lines = [f"Decode speed by weight format: {label}, budget all, {args.threads} threads, greedy replies of "
             f"{args.decode} tokens from a {args.prompt_len}-token prompt; {args.rounds} rounds, formats in "
             "rotating order. Ratio: median over rounds of the format's rate over the first format's rate in "
             "the same round.", "",
             f"| format | decode tok/s (median) | ÷ {names[0]} | tokens | decode path |", "|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['decode_tokens_per_s']:.1f} | {r[over]:.2f} | {r['decode_tokens']} "
              f"| {r['decode_path']} |" for r in rows]
    kind = f"format-speed-{label}" + (f"-{args.tag}" if args.tag else "")
    write_report(args.out, kind, {"model": label, "threads": args.threads, "decode": args.decode,
                                  "rounds": args.rounds, "exact": args.exact, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
