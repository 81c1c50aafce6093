"""`moescope` on the command line: generate, chat, info (the headless face of the engine).

Heavy imports (torch, transformers) happen inside the commands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from engine.errors import MoEScopeError
from engine.hub.cli import add_models_parser, run_models
from engine.trace_cli import add_trace_parser, run_trace


def _add_model_args(p: argparse.ArgumentParser, *, budget_default: str = "all") -> None:
    p.add_argument("--model", required=True, help="checkpoint folder, or 'demo' for the embedded demo model")
    p.add_argument("--budget", default=budget_default, help="expert cache size: 512MiB, 2GiB, 25%% (of all expert bytes) or all")
    p.add_argument("--store", default="auto", choices=["auto", "disk", "ram"], help="where experts live outside the cache")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--policy", default="lru", type=_policy_spec, metavar="{" + ",".join(_policy_names()) + "}",
                   help="cache policy; options after a colon, e.g. promoe:k=3 (see `moescope policies`)")
    p.add_argument("--allocation", default="planned", choices=["planned", "uniform"],
                   help="split the budget across layers by measured miss curves (planned; uniform until routing "
                   "is seen) or evenly")
    p.add_argument("--cpu-experts", default="never", choices=["auto", "never"],
                   help="with a CUDA GPU and --store ram: compute a missing expert on the CPU when a latency model "
                   "calibrated at load says that beats copying it (Fiddler). No effect on CPU-only machines")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="record routing (request, token, layer, experts, weights) to FILE as JSON lines")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--fast-decode", action="store_true",
                   help="CPU decode steps with faster kernels: bf16/fp16 matrix-vector products through torch's native "
                   "kernel instead of oneDNN, one-query attention as float32 matmuls instead of SDPA's flash kernel. "
                   "Same arithmetic summed in another order, so not bit-identical to transformers' default kernels "
                   "(bench.decode_limit counts the greedy tokens that still match); float32 models unaffected")
    p.add_argument("--no-pack-weights", dest="pack_weights", action="store_false",
                   help="CPU bf16/fp16: keep expert matrices in the plain layout instead of pre-arranging them for "
                   "oneDNN as they are loaded (same results either way; packed decodes faster)")
    p.add_argument("--allow-pickle", action="store_true", help="accept .bin/.pt weights (pickle can run code)")
    p.add_argument("--trust-remote-code", action="store_true", help="run Python code shipped with the model")


def _policy_names() -> list[str]:
    from engine.policies import POLICIES

    return list(POLICIES)


def _policy_spec(text: str) -> str:
    from engine.policies import parse_policy

    try:
        parse_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_sampling_args(p: argparse.ArgumentParser, *, temperature: float) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moescope", description="Run and inspect Mixture-of-Experts models under a memory budget.")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    _add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (chat template applied unless --raw)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids (implies --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system prompt (chat template only)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_sampling_args(gen, temperature=0.0)

    chat = sub.add_parser("chat", help="chat in the terminal, replies streamed")
    _add_model_args(chat)
    chat.add_argument("--system", default=None)
    _add_sampling_args(chat, temperature=0.7)

    info = sub.add_parser("info", help="a model's MoE geometry and memory needs")
    info.add_argument("--model", required=True)
    info.add_argument("--json", action="store_true")
    info.add_argument("--trust-remote-code", action="store_true")
    info.add_argument("--allow-pickle", action="store_true")

    sub.add_parser("policies", help="list the cache policies")
    add_trace_parser(sub)
    add_models_parser(sub)
    return parser


def _load(args: argparse.Namespace, *, budget: str | None = None):
    from engine.runtime import LoadOptions, MoERuntime

    options = LoadOptions(
        model=args.model,
        budget=budget or getattr(args, "budget", "all"),
        store=getattr(args, "store", "auto"),
        device=getattr(args, "device", "auto"),
        policy=getattr(args, "policy", "lru"),
        dtype=getattr(args, "dtype", "auto"),
        allow_pickle=args.allow_pickle,
        trust_remote_code=args.trust_remote_code,
        allocation=getattr(args, "allocation", "planned"),
        cpu_experts=getattr(args, "cpu_experts", "never"),
        trace=getattr(args, "trace", None),
        fast_decode=getattr(args, "fast_decode", False),
        pack_weights=getattr(args, "pack_weights", True),
    )
    runtime = MoERuntime(options)
    for note in (runtime.plan.note, runtime.profile_note, runtime.cpu_experts_note):
        if note:
            print(f"moescope: note: {note}", file=sys.stderr)
    return runtime


def _settings(args: argparse.Namespace):
    from engine.sampling import SamplingSettings

    return SamplingSettings(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=list(args.stop),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.generation import Generator

    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise MoEScopeError("--prompt-ids takes comma-separated integers, e.g. 1,2,3") from None
    runtime = _load(args)
    generator = Generator(runtime)
    if args.prompt_ids is None:
        if args.raw:
            prompt_ids = generator.encode_raw(args.prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt_ids = generator.encode_chat(messages)
    vocab = runtime.model.config.get_text_config().vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise MoEScopeError(f"--prompt-ids has ids outside this model's vocabulary (0..{vocab - 1})")
    stream = None if args.json else (lambda delta: print(delta, end="", flush=True))
    result = generator.generate(prompt_ids, _settings(args), on_text=stream)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        s = result.stats
        print(
            f"[{s.prefill_tokens} prompt tokens at {s.prefill_tokens_per_s:.1f} tok/s, {s.decode_tokens} generated at "
            f"{s.decode_tokens_per_s:.1f} tok/s, TTFT {s.ttft_s:.2f} s, hit rate {s.hit_rate:.1%}]",
            file=sys.stderr,
        )
    runtime.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.generation import Generator

    runtime = _load(args)
    generator = Generator(runtime)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    info = runtime.info()
    print(f"{info.name}: {info.num_experts} experts x {info.num_moe_layers} MoE layers, budget "
          f"{runtime.cache.budget_bytes / 2**20:.0f} MiB. Empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        try:
            result = generator.generate(generator.encode_chat(messages), _settings(args),
                                        on_text=lambda d: print(d, end="", flush=True))
        except KeyboardInterrupt:
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": result.text})
        s = result.stats
        print(f"[{s.decode_tokens_per_s:.1f} tok/s, hit rate {s.hit_rate:.1%}]", file=sys.stderr)
    runtime.close()
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.inspect_model import inspect_checkpoint
    from engine.sizes import format_bytes

    info = inspect_checkpoint(args.model, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    if args.json:
        print(json.dumps(asdict(info)))
        return 0
    print(f"model            {info.name} ({info.architecture})")
    print(f"layers           {info.num_layers} ({info.num_moe_layers} with experts)")
    print(f"experts          {info.num_experts} per layer, top-{info.top_k}")
    print(f"bytes per expert {format_bytes(info.expert_bytes)} ({info.dtype})")
    print(f"all experts      {format_bytes(info.all_expert_bytes)}")
    print(f"dense weights    {format_bytes(info.dense_bytes)}")
    print(f"minimum budget   {format_bytes(info.min_budget_bytes)}")
    print(f"context          {info.context_length} tokens")
    return 0


def cmd_policies(_: argparse.Namespace) -> int:
    from engine.policies import POLICIES

    for name, cls in POLICIES.items():
        print(f"{name:12s} {'lossless' if cls.lossless else 'LOSSY   '} {cls.description}")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "policies": cmd_policies, "trace": run_trace}
COMMANDS["models"] = run_models


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return COMMANDS[args.command](args)
    except MoEScopeError as exc:
        print(f"moescope: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
