"""`moescope`: the GUI with no arguments (or GUI flags), the engine's CLI for any subcommand.

The engine CLI is imported only when a subcommand is given, so opening the window never pays for
(or depends on) torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine.errors import MODEL_ACCEPTS  # torch-free: the window's --help stays instant

ENGINE_COMMANDS_HINT = "generate, chat, serve, info, policies, models, trace"  # tests hold it to the engine's parser


def build_gui_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moescope",
        description="Chat with Mixture-of-Experts models larger than your memory, and watch the experts work.",
        epilog=f"Engine commands (no window): moescope COMMAND --help, COMMAND one of {ENGINE_COMMANDS_HINT}. "
               "Benchmarks run from a source checkout: python -m bench.NAME.",
    )
    parser.add_argument("--model", help=f"{MODEL_ACCEPTS} (default: the last model used)")
    parser.add_argument("--budget", help="expert cache size: 512MiB, 2GiB, 25%% or all (default: the last one)")
    parser.add_argument("--screenshot", metavar="OUT.png", help="send --prompt, wait for the reply, save the window, exit")
    parser.add_argument("--prompt", help="with --screenshot: the message to send")
    parser.add_argument("--library", metavar="NAME",
                        help="with --screenshot instead of --prompt: open the model library, select NAME, save the "
                             "library once its verdict is in")
    parser.add_argument("--reload-as", metavar="FORMAT",
                        help="with --screenshot --prompt: then reload the model with its experts in FORMAT (q4_k, "
                             "q8_0…), ask again, and add the window's layout after the reload to the report")
    parser.add_argument("--show", metavar="PANEL", action="append", default=[],
                        help="with --screenshot: bring this panel's tab to the front first (heatmap, hit-rate, "
                             "traffic, budget, system, server; may be given twice)")
    parser.add_argument("--timeout", type=float, default=600.0, help="with --screenshot: give up after this many seconds")
    parser.add_argument("--theme", choices=["system", "light", "dark"], help="override the colour theme")
    parser.add_argument("--check-libraries", action="store_true",
                        help="check that the system libraries Qt's window needs are installed, say which are not, exit")
    return parser


def is_engine_command(argv: Sequence[str]) -> bool:
    """A first argument that is not an option names an engine subcommand."""
    return bool(argv) and not argv[0].startswith("-")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_engine_command(argv):
        from engine.cli.main import main as engine_main  # lazy: the GUI path never imports torch

        return engine_main(argv)
    args = build_gui_parser().parse_args(argv)
    if args.screenshot and not (args.prompt or args.library):
        print("moescope: error: --screenshot needs --prompt (or --library NAME)", file=sys.stderr)
        return 2
    # Before any Qt object exists: a missing library or display gets one line, not Qt's abort.
    from app.platform_check import EXIT_NO_WINDOW, library_problem, window_problem

    problem = library_problem() if args.check_libraries else window_problem()
    if args.check_libraries and not problem:
        return 0
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_NO_WINDOW
    from app.gui import run_gui

    return run_gui(args)


def entry() -> NoReturn:
    """The installed `moescope` command: main, then out without the interpreter's final collection
    (seconds after an engine command, engine/system/process_exit.py)."""
    from engine.system.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
