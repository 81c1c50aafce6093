"""The load and sampling options of the command line, taken from the protocol's dataclasses.

`engine.protocol.LoadModel` and `SamplingSettings` are the one definition of these settings:
their defaults are the CLI's, and `SamplingSettings.problem()` is the one check of their ranges.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from engine import protocol as p
from engine.errors import MODEL_ACCEPTS, MoEScopeError

LOAD = {f.name: f.default for f in fields(p.LoadModel) if f.name != "path"}
SAMPLING = {f.name: f.default for f in fields(p.SamplingSettings) if f.name != "stop"}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"{MODEL_ACCEPTS} for the embedded demo model")
    parser.add_argument("--budget", default=LOAD["budget"],
                        help="expert cache size: 512MiB, 2GiB, 25%% (of all expert bytes) or all")
    parser.add_argument("--store", default=LOAD["store"], choices=["auto", "disk", "ram"],
                        help="where experts live outside the cache")
    parser.add_argument("--device", default=LOAD["device"], choices=["auto", "cpu", "cuda"])
    parser.add_argument("--policy", default=LOAD["policy"], type=_policy_spec,
                        metavar="{" + ",".join(_policy_names()) + "}",
                        help="cache policy; options after a colon, e.g. promoe:k=3 (see `moescope policies`)")
    parser.add_argument("--allocation", default=LOAD["allocation"], choices=["planned", "uniform"],
                        help="split the budget across layers by measured miss curves (planned; uniform until routing "
                        "is seen) or evenly")
    parser.add_argument("--cpu-experts", default=LOAD["cpu_experts"], choices=["auto", "never"],
                        help="with a CUDA GPU and --store ram: compute a missing expert on the CPU when a latency model "
                        "calibrated at load says that beats copying it (Fiddler). No effect on CPU-only machines")
    parser.add_argument("--trace", metavar="FILE", default=LOAD["trace"],
                        help="record routing (request, token, layer, experts, weights) to FILE as JSON lines")
    parser.add_argument("--dtype", default=LOAD["dtype"], choices=["auto", "float32", "bfloat16", "float16"])
    add_format_arg(parser)
    parser.add_argument("--exact", dest="fast_decode", action="store_false", default=LOAD["fast_decode"],
                        help="decode on transformers' own kernels, bit-identical to stock transformers. By default "
                        "bf16 decode on a CPU runs MoEScope's native kernels (a layer's experts in one pass, "
                        "Llama-style attention in three calls; a whole Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral token in one call when "
                        "every expert is resident): the same arithmetic summed in another order, so not bit-identical "
                        "(bench.decode_pair counts the greedy tokens that still match)")
    # --int8-prompt: its name while it applied to prompts alone, kept so old scripts still run
    parser.add_argument("--int8-inputs", "--int8-prompt", dest="int8_inputs", action="store_true",
                        default=LOAD["int8_inputs"],
                        help="lossy, opt-in: 4-bit and other K-quant weights (Q4_K, Q6_K, ...) multiply their inputs "
                        "rounded to 8 bits (one scale per 256 values, llama.cpp's precision) in integers, in prompts "
                        "and decode alike: faster on most CPUs, slightly different answers (docs/performance.md "
                        "measures the cost); a prompt beside AMX tiles keeps its exact inputs, which run faster there")
    parser.add_argument("--fast-decode", action=_Deprecated, nargs=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-pack-weights", dest="pack_weights", action="store_false", default=LOAD["pack_weights"],
                        help="CPU bf16/fp16: keep expert matrices in the plain layout instead of pre-arranging them for "
                        "oneDNN as they are loaded (same results either way; packed decodes faster)")
    parser.add_argument("--allow-pickle", action="store_true", help="accept .bin/.pt weights (pickle can run code)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run Python code shipped with the model")


class _Deprecated(argparse.Action):
    """`--fast-decode`: the native kernels are the default now; accepted so old scripts still run."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"moescope: note: {option_string} is the default now and will be removed; --exact selects "
              "transformers' kernels", file=sys.stderr)


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-format", default=LOAD["expert_format"], metavar="FORMAT",
                        help="routed experts in a block format: 8bit (q8_0), 6bit (q6_k), 4bit (q4_k), 3bit (q3_k), "
                        "2bit (q2_k), or original. Converted once into MoEScope's cache folder; approximate, "
                        "measured quality cost in docs/performance.md")
    parser.add_argument("--dense-format", default=LOAD["dense_format"], metavar="FORMAT",
                        help="every other linear layer (attention, shared experts, LM head; not the routers) in a "
                        "block format, the same choices (mixed quantization: e.g. --expert-format 4bit "
                        "--dense-format 8bit)")


def load_settings(args: argparse.Namespace) -> p.LoadModel:
    """The parsed options as the engine's load settings."""
    return p.LoadModel(path=args.model, **{name: getattr(args, name) for name in LOAD if hasattr(args, name)})


def add_sampling_args(parser: argparse.ArgumentParser, *, temperature: float = SAMPLING["temperature"]) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=SAMPLING["max_new_tokens"])
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=SAMPLING["top_p"])
    parser.add_argument("--top-k", type=int, default=SAMPLING["top_k"], help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=SAMPLING["repetition_penalty"])
    parser.add_argument("--seed", type=int, default=SAMPLING["seed"])
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_settings(args: argparse.Namespace) -> p.SamplingSettings:
    """The parsed options as sampling settings; one clear line naming the option when one is out of range."""
    settings = p.SamplingSettings(stop=list(args.stop), **{name: getattr(args, name) for name in SAMPLING})
    if problem := settings.problem():
        raise MoEScopeError(f"--{problem.field.replace('_', '-')} {problem.message}")
    return settings


def _policy_names() -> list[str]:
    from engine.accounting.policies import POLICIES

    return list(POLICIES)


def _policy_spec(text: str) -> str:
    from engine.accounting.policies import parse_policy

    try:
        parse_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
