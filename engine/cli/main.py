"""`moescope` on the command line: generate, chat, info (the headless face of the engine).

Heavy imports (torch, transformers) happen inside the commands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.cli.args import add_format_arg, add_model_args, add_sampling_args, load_settings, sampling_settings
from engine.cli.models import add_models_parser, run_models
from engine.cli.serve import add_serve_parser, run_serve
from engine.cli.trace import add_trace_parser, run_trace
from engine.errors import MODEL_ACCEPTS, MoEScopeError
from engine.protocol import CONTEXT_OVERFLOW, TEXT_ONLY_NOTE
from engine.system.process_settings import apply_process_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moescope", description="Run and inspect Mixture-of-Experts models under a memory budget.")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (chat template applied unless --raw)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids (implies --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system prompt (chat template only)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(gen, temperature=0.0)  # a one-shot answer is deterministic unless asked otherwise

    chat = sub.add_parser("chat", help="chat in the terminal, replies streamed")
    add_model_args(chat)
    chat.add_argument("--system", default=None)
    chat.add_argument("--context-overflow", choices=CONTEXT_OVERFLOW, default=CONTEXT_OVERFLOW[0],
                      help="when the history outgrows the model's context: leave the oldest turns out of what it "
                      "sees (the default), or stop with a message; /context changes it in the chat")
    add_sampling_args(chat)

    info = sub.add_parser("info", help="a model's MoE geometry and memory needs")
    info.add_argument("--model", required=True, help=MODEL_ACCEPTS)
    info.add_argument("--json", action="store_true")
    info.add_argument("--trust-remote-code", action="store_true")
    info.add_argument("--allow-pickle", action="store_true")
    add_format_arg(info)

    sub.add_parser("policies", help="list the cache policies")
    add_trace_parser(sub)
    add_models_parser(sub)
    add_serve_parser(sub)
    return parser


def _load(args: argparse.Namespace):
    from engine.decode.runtime import MoERuntime
    from engine.system.progress import TextProgress

    progress = TextProgress()  # silent for a quick load; a conversion shows a bar and the time left
    runtime = MoERuntime(load_settings(args), progress=progress)
    progress.end()
    for note in (*runtime.load_notes(), runtime.plan.note):
        if note:
            print(f"moescope: note: {note}", file=sys.stderr)
    return runtime


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.decode.generation import Generator

    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise MoEScopeError("--prompt-ids takes comma-separated integers, e.g. 1,2,3") from None
        if not prompt_ids:
            raise MoEScopeError("--prompt-ids is empty; pass the token ids to send, e.g. --prompt-ids 1,2,3")
    elif not args.prompt.strip():  # the model would answer a blank turn: refused before anything loads
        raise MoEScopeError("--prompt is empty; pass the text to send, e.g. --prompt 'What is 4 plus 7?'")
    settings = sampling_settings(args)  # checked before anything loads
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
    result = generator.generate(prompt_ids, settings, on_text=stream)
    if args.json:  # with what the load measured of the engine's own memory, to weigh the peak against
        print(json.dumps(result.to_dict() | {"engine_overhead_bytes": runtime.overhead.total_bytes,
                                             "decode_path": runtime.decode_path,
                                             "decode_path_reason": runtime.decode_path_reason,
                                             "kernels": _kernels_report()}))
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
    from engine.cli.chat import run_chat  # the loop, its /commands and the context handling

    settings = sampling_settings(args)
    return run_chat(_load(args), settings, args.system, args.context_overflow)


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.accounting.sizes import format_bytes
    from engine.formats.blocks import parse_format
    from engine.hub.local import resolve_model
    from engine.model.inspect import inspect_checkpoint

    try:
        fmt = parse_format(args.expert_format)
    except ValueError as exc:
        raise MoEScopeError(str(exc)) from None
    info = inspect_checkpoint(resolve_model(args.model), allow_pickle=args.allow_pickle,
                              trust_remote_code=args.trust_remote_code, expert_format=fmt)
    info.engine_overhead_bytes = _engine_overhead_here(resolve_model(args.model))
    kernels = _kernels_report()
    if args.json:
        print(json.dumps(asdict(info) | {"kernels": kernels}))
        return 0
    print(f"model            {info.name} ({info.architecture})")
    print(f"layers           {info.num_layers} ({info.num_moe_layers} with experts)")
    print(f"experts          {info.num_experts} per layer, top-{info.top_k}")
    stored = info.dtype if info.expert_format == "original" else f"{info.expert_format}, computed in {info.dtype}"
    print(f"bytes per expert {format_bytes(info.expert_bytes)} ({stored})")
    print(f"all experts      {format_bytes(info.all_expert_bytes)}")
    print(f"dense weights    {format_bytes(info.dense_bytes)}")
    print(f"minimum budget   {format_bytes(info.min_budget_bytes)}")
    print(f"engine overhead  {format_bytes(info.engine_overhead_bytes)} (the engine process beside the weights at "
          "budget all: Python, torch, transformers, this model's code and bookkeeping)")
    whole = info.dense_bytes + info.all_expert_bytes + info.engine_overhead_bytes
    print(f"at budget all    {format_bytes(whole)} (dense + all experts + engine overhead, before the KV cache)")
    print(f"context          {info.context_length} tokens")
    if info.text_only:
        print(f"input            {TEXT_ONLY_NOTE}")
    if kernels["variant"]:
        print(f"native kernels   {kernels['variant']} ({kernels['label']}; code paths {kernels['code_path']})")
        for reason in kernels["passed_over"]:
            print(f"                 not {reason}")
    else:
        print(f"native kernels   none: {kernels['problem']}; decode runs on transformers' kernels")
    return 0


def _kernels_report() -> dict:
    """Which native kernel variant this process runs and why not a better one, or why none."""
    from engine.decode.native import kernels as native

    loaded = native.load()
    if loaded is None:
        return {"variant": "", "label": "", "code_path": "", "passed_over": native.why_not_better(),
                "problem": native.status()}
    return {"variant": loaded.variant.name, "label": loaded.variant.label, "code_path": loaded.code_path(),
            "passed_over": native.why_not_better(), "problem": ""}


def _engine_overhead_here(path: Path) -> int:
    """What the engine costs by itself with this model: this process's resident memory with the
    generation path imported and no weights read (the inspection built the model on the meta device),
    or the footprint the engine will have at budget all (engine.hub.footprint), whichever is larger."""
    from engine.decode import generation, runtime  # noqa: F401  (what a load imports)
    from engine.hub.footprint import engine_own_bytes
    from engine.system.memory import rss_bytes

    here = rss_bytes()
    try:
        if path.is_dir():
            from engine.hub.estimate import estimate_folder

            est = estimate_folder(path)
        else:
            from engine.hub.gguf_info import estimate_gguf, read_header

            est = estimate_gguf(read_header(path))
    except MoEScopeError:  # sized by the inspection already; the process's own figure stands
        return here
    return max(here, engine_own_bytes(est, "all"))


def cmd_policies(_: argparse.Namespace) -> int:
    from engine.accounting.policies import POLICIES

    for name, cls in POLICIES.items():
        print(f"{name:12s} {'lossless' if cls.lossless else 'LOSSY   '} {cls.description}")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "policies": cmd_policies, "trace": run_trace}
COMMANDS["models"] = run_models
COMMANDS["serve"] = run_serve


def main(argv: Sequence[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
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
    from engine.system.process_exit import exit_process

    exit_process(main())
