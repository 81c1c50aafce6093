"""`moescope serve`: the model as an OpenAI- and Ollama-compatible server, with its own engine process.

The server itself is torch-free (`engine.serve`): it loads nothing but the protocol client, and the
worker process runs the model, restarted (and the model reloaded) if it crashes.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from engine import protocol as p
from engine.cli.args import add_model_args, load_settings
from engine.errors import MoEScopeError
from engine.serve import DEFAULT_PORT
from engine.serve.hub import DEFAULT_SERVICE_S


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model over the OpenAI API (/v1) and Ollama's (/api); "
                           "loopback only unless --api-key")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; anything but loopback needs --api-key (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    serve.add_argument("--api-key", default=os.environ.get("MOESCOPE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every request (default: $MOESCOPE_API_KEY)")
    serve.add_argument("--max-queue", type=int, default=16,
                       help="requests waiting or running at once (default 16); one more gets 429 with Retry-After: "
                       "the median service time of the last 16 finished requests (from when the engine took each "
                       f"up to its end, not counting its wait in the queue; {DEFAULT_SERVICE_S:g} s until one has "
                       "finished) times the requests ahead, rounded up, at least 1 s")
    serve.add_argument("--parallel", type=int, default=0, metavar="N",
                       help="replies decoded at once, each with its own KV cache: they take turns of one forward "
                       "each, experts they share are read once a turn, a new prompt goes in 512-token chunks between "
                       "the others' tokens (default 0: as many as the free memory holds a 4096-token KV cache for, "
                       "at most 4); the window's chat may join as one more. --max-queue counts these too")
    serve.add_argument("--max-body-kib", type=int, default=4096, help="largest request body accepted (default 4096)")
    serve.add_argument("--return-routed-experts", action="store_true",
                       help="every response carries routed_experts [tokens, layers, top_k], as vLLM's flag does "
                       "(a request can ask with return_routed_experts: true)")


def run_serve(args: argparse.Namespace) -> int:
    from engine.process.client import EngineClient
    from engine.serve.app import ServerSettings, create_app
    from engine.serve.hub import EngineHub
    from engine.serve.runner import check_bind, listen, serve_forever, url_of

    if args.max_queue < 1 or args.max_body_kib < 1 or args.parallel < 0:
        raise MoEScopeError("--max-queue and --max-body-kib must be at least 1, --parallel at least 0 (0: automatic)")
    check_bind(args.host, args.api_key)
    sock = listen(args.host, args.port)
    loaded = threading.Event()
    failed: list[p.Error] = []

    def on_event(event) -> None:
        hub.on_event(event)
        if isinstance(event, p.ModelLoaded):
            loaded.set()
        elif isinstance(event, p.Error) and not loaded.is_set() and event.request_id is None:
            failed.append(event)
            loaded.set()

    def restart() -> None:
        print("moescope: the engine crashed; restarting it and reloading the model", file=sys.stderr, flush=True)
        threading.Thread(target=client.restart, name="moescope-restart", daemon=True).start()

    client = EngineClient(on_event)
    hub = EngineHub(client.send, max_queue=args.max_queue, aliases=(args.model,), on_crash=restart,
                    on_log=lambda entry: print(f"moescope: {entry.line()}", file=sys.stderr, flush=True))
    client.start()
    try:
        client.send(load_settings(args))
        loaded.wait()
        if failed:
            raise MoEScopeError(failed[0].message)
        settings = ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_kib * 1024,
                                  return_routed_experts=args.return_routed_experts)
        model = hub.model.name if hub.model else args.model
        parallel = hub.model.parallel if hub.model else 1
        print(f"moescope: serving {model} on {url_of(sock)} (OpenAI API; Ollama's at /api; {parallel} replies at once, "
              f"{args.max_queue} waiting or running at most; Ctrl-C stops)", file=sys.stderr, flush=True)
        serve_forever(create_app(hub, settings), sock)
    finally:
        client.stop()
        sock.close()
    return 0
