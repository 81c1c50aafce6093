"""Many clients at once on the local server: `moescope serve` against llama.cpp's `llama-server -np 4`,
the same load from the official `openai` client, loopback only, a bounded number of requests.

Both serve the Q4_K_M GGUF of a bench geometry (bench.gguf_files; qwen3moe-64e by default), with
`--threads` threads (MoEScope: OMP_NUM_THREADS; budget all, RAM store; `--parallel 4` once
`moescope serve --help` lists it, else it serves the requests in turn and the table says so;
llama.cpp: `-t`, `-np 4`, weights read in at load). MoEScope runs twice, as it ships (16-bit inputs)
and with the opt-in `--int8-inputs` (the inputs of its K-quant matrices rounded to 8 bits, as
llama.cpp always rounds them: the same precision as llama.cpp; `--no-int8` leaves that one out). Every request is a `/v1/completions` with a
fresh prompt of token ids (no prefix cache helps either side), temperature 0, `--tokens` tokens,
streamed with the usage at the end.

Per repetition, each phase on each server in turn (the order flips every repetition), medians
over the repetitions:
1. 4 requests one after another, then 4 at once: completion tokens / wall time each, and the
   gain (at once / in turn).
2. Time to first token of a new request while 3 others stream (p95 over `--probes` rounds a
   repetition; the 3 are cancelled after each probe), against the TTFT of the 4 sent in turn.
Then, MoEScope alone at a 50 % budget, one repetition (counts, not timings): 3. expert loads per generated token (its telemetry's
bytes loaded / one expert's bytes) with 1 stream and with 4; and 4. the bound on batching: the
bytes one batch step of 4 reads (dense weights once, the union of the streams' experts, from the
routing the server returns and from random routing) against 4 tokens of one stream.

`--isa avx2` holds both to AVX2 and FMA on a CPU that has more (as bench.llamacpp does).

    python -m bench.serve_load [--tokens 64] [--repetitions 3] [--probes 2] [--skip-llamacpp] [--no-int8] [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

STREAMS = 4  # the load: 4 clients at once (llama-server -np 4, moescope serve --parallel 4)
KIND = "serve-load"
INT8 = "moescope --int8-inputs"  # MoEScope at llama.cpp's precision: its inputs rounded to 8 bits (opt-in, lossy)
SERVERS = ("moescope", INT8, "llama.cpp")  # the table's order


# ---------------------------------------------------------------- statistics (tested on fixed numbers)

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-repetition ratios (each pair measured side by side)."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError("ratios need pairs")
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def expected_union(n_experts: int, top_k: int, streams: int) -> float:
    """Distinct experts one layer runs for `streams` tokens whose top-k are independent and uniform."""
    return n_experts * (1 - (1 - top_k / n_experts) ** streams)


def step_union(routings: list[list[list[list[int]]]]) -> list[float]:
    """Per batch step (token position all streams reached), the mean over layers of the distinct
    experts the streams ran. `routings`: one [tokens, layers, top_k] list per stream, -1 pads."""
    steps = min(len(r) for r in routings)
    out = []
    for t in range(steps):
        layers = len(routings[0][t])
        counts = [len({e for r in routings for e in r[t][layer] if e >= 0}) for layer in range(layers)]
        out.append(sum(counts) / layers)
    return out


def batching_bound(dense_bytes: float, expert_bytes: float, top_k: float, union: float, streams: int) -> float:
    """The most a batch of `streams` can gain over one stream where a step costs the bytes it reads:
    `streams` tokens of one stream read `streams` x (dense + top-k experts), one batch step reads the
    dense weights once and each expert of the union once (per layer; `expert_bytes` summed over layers)."""
    return streams * (dense_bytes + top_k * expert_bytes) / (dense_bytes + union * expert_bytes)


# ---------------------------------------------------------------- servers

@dataclass
class Server:
    name: str
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    note: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moescope_parallel_flag() -> bool:
    """Whether this checkout's `moescope serve` takes --parallel (continuous batching)."""
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "serve", "--help"], capture_output=True, text=True)
    return "--parallel" in proc.stdout


def _wait_ready(proc: subprocess.Popen, log: Path, ready, what: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n" + log.read_text()[-2000:])
        url = ready()
        if url:
            return url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s:\n" + log.read_text()[-2000:])


@contextmanager
def moescope_server(gguf: Path, threads: int, budget: str, logdir: Path, parallel: bool, int8: bool = False):
    log = logdir / f"moescope-{budget.replace('%', 'pct')}{'-int8' if int8 else ''}.log"
    cmd = [sys.executable, "-m", "engine.cli.main", "serve", "--model", str(gguf), "--budget", budget, "--store", "ram",
           "--port", "0", "--max-queue", "64", *(["--parallel", str(STREAMS)] if parallel else []),
           *(["--int8-inputs"] if int8 else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def ready() -> str | None:
        for line in log.read_text().splitlines():
            if line.startswith("moescope: serving ") and " on http" in line:
                return line.split(" on ", 1)[1].split()[0].removesuffix("/").removesuffix("/v1")
        return None

    note = f"--parallel {STREAMS}" if parallel else "no --parallel yet: requests served in turn"
    if int8:
        note += ", --int8-inputs (opt-in, lossy: inputs to K-quant matrices rounded to 8 bits, as llama.cpp's)"
    yield from _serving(Server(INT8 if int8 else "moescope", _wait_ready(proc, log, ready, "moescope serve", 900), proc,
                               note))


@contextmanager
def llama_server(tool: Path, gguf: Path, threads: int, ctx_per_slot: int, logdir: Path, isa: str = "native"):
    import httpx

    from bench.llamacpp_build import build_target

    port = free_port()
    cmd = [str(tool), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(STREAMS),
           "-c", str(ctx_per_slot * STREAMS), "--host", "127.0.0.1", "--port", str(port), "-lm", "none",
           "--no-ui"]  # -lm none: weights read in at load, as our RAM store holds them
    log = logdir / "llama-server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> str | None:
        try:
            return url if httpx.get(f"{url}/health", timeout=2).status_code == 200 else None
        except httpx.HTTPError:
            return None

    yield from _serving(Server("llama.cpp", _wait_ready(proc, log, ready, "llama-server", 300), proc,
                               f"-np {STREAMS}, continuous batching; built for {build_target(isa)}"))


def _serving(server: Server):
    try:
        yield server
    finally:
        server.proc.terminate()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


# ---------------------------------------------------------------- the load

@dataclass
class Reply:
    """One streamed request, timed from its send (perf_counter seconds)."""

    sent: float
    first: float | None = None  # the first chunk with a choice: its first token
    done: float | None = None
    tokens: int = 0  # the usage's completion tokens (else the chunks counted)
    routing: list | None = None  # [tokens, layers, top_k] when asked for and served

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.done) - self.sent


class Load:
    """Streamed `/v1/completions` against one server: a fresh prompt of token ids each time."""

    def __init__(self, server: Server, vocab: int, prompt_len: int, tokens: int, seed: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=900)
        self.model = self.client.models.list().data[0].id
        self.vocab, self.prompt_len, self.tokens = vocab, prompt_len, tokens
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def prompt(self) -> list[int]:
        with self.lock:  # past the placeholder tokenizer's specials (0-2)
            return [self.rng.randrange(3, self.vocab) for _ in range(self.prompt_len)]

    def request(self, routing: bool = False, cancel: threading.Event | None = None, into: Reply | None = None) -> Reply:
        """One request, streamed to its end (or until `cancel` is set: the connection closed), filling
        `into` as it goes when given."""
        extra = {"ignore_eos": True, **({"return_routed_experts": True} if routing else {})}
        prompt = self.prompt()
        reply = into or Reply(0.0)
        reply.sent = time.perf_counter()
        stream = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=self.tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body=extra)
        chunks = 0
        with stream:
            for chunk in stream:
                if chunk.choices:
                    chunks += 1
                    reply.first = reply.first or time.perf_counter()
                    routed = (chunk.choices[0].model_extra or {}).get("routed_experts")
                    reply.routing = routed if routed is not None else reply.routing
                if chunk.usage is not None:
                    reply.tokens = chunk.usage.completion_tokens
                if cancel is not None and cancel.is_set():
                    break
        reply.done = time.perf_counter()
        reply.tokens = reply.tokens or chunks
        return reply

    def in_turn(self, n: int = STREAMS, routing: bool = False) -> tuple[float, list[Reply]]:
        """`n` requests one after another: (wall seconds, replies)."""
        start = time.perf_counter()
        replies = [self.request(routing) for _ in range(n)]
        return time.perf_counter() - start, replies

    def at_once(self, n: int = STREAMS, routing: bool = False) -> tuple[float, list[Reply]]:
        """`n` requests sent together: (wall seconds from the first send to the last end, replies)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda _: self.request(routing), range(n)))
        return time.perf_counter() - start, replies

    def probe_under_load(self, others: int = STREAMS - 1) -> float:
        """TTFT of one request sent once `others` are streaming (each has its first token: they decode,
        none is still reading its prompt); the others are cancelled after it."""
        cancel = threading.Event()
        started: list[Reply] = []
        with ThreadPoolExecutor(others) as pool:
            futures = [pool.submit(self._background, cancel, started) for _ in range(others)]
            deadline = time.monotonic() + 600
            while not (len(started) == others and all(r.first for r in started)) and time.monotonic() < deadline:
                if any(f.done() for f in futures):
                    break  # all finished already: nothing to wait for
                time.sleep(0.01)
            probe = self.request()
            cancel.set()
            for f in futures:
                f.result()
        return probe.ttft

    def _background(self, cancel: threading.Event, started: list[Reply]) -> None:
        reply = Reply(0.0)
        started.append(reply)
        self.request(cancel=cancel, into=reply)


def telemetry(server: Server) -> dict:
    """MoEScope's latest telemetry snapshot (its stream sends the current one first)."""
    import httpx

    with httpx.stream("GET", f"{server.url}/moescope/v1/telemetry", timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                return json.loads(line[5:])
    raise RuntimeError("the telemetry stream ended without a snapshot")


# ---------------------------------------------------------------- measurements

def throughput(wall: float, replies: list[Reply]) -> float:
    return sum(r.tokens for r in replies) / wall


def run_phase(load: Load, phase: str, probes: int) -> dict:
    """One of measurements 1 and 2 on one server: 4 in turn (each alone: its TTFT the one alone),
    4 at once, or `probes` TTFTs beside 3 streams."""
    if phase == "probes":
        return {"ttft_loaded_s": [load.probe_under_load() for _ in range(probes)]}
    wall, replies = load.in_turn() if phase == "in_turn" else load.at_once()
    out = {f"{phase}_tokens_per_s": throughput(wall, replies), f"{phase}_tokens": [r.tokens for r in replies]}
    return out | ({"ttft_alone_s": [r.ttft for r in replies]} if phase == "in_turn" else {})


def summarise(reps: list[dict]) -> dict:
    alone = [t for r in reps for t in r["ttft_alone_s"]]
    loaded = [t for r in reps for t in r["ttft_loaded_s"]]
    return {"in_turn_tokens_per_s": statistics.median(r["in_turn_tokens_per_s"] for r in reps),
            "at_once_tokens_per_s": statistics.median(r["at_once_tokens_per_s"] for r in reps),
            "gain": median_ratio([r["at_once_tokens_per_s"] for r in reps], [r["in_turn_tokens_per_s"] for r in reps]),
            "ttft_alone_p95_s": percentile(alone, 95), "ttft_loaded_p95_s": percentile(loaded, 95),
            "ttft_loaded_over_alone": percentile(loaded, 95) / percentile(alone, 95)}


def side_by_side(loads: dict[str, Load], args) -> dict:
    """Measurements 1 and 2, each phase run on one server then the other (the order flips every
    repetition), then each summarised and the per-repetition ratios MoEScope / llama.cpp."""
    reps: dict[str, list[dict]] = {name: [] for name in loads}
    for rep in range(args.repetitions):
        order = list(loads) if rep % 2 == 0 else list(reversed(loads))
        runs: dict[str, dict] = {name: {} for name in loads}
        for phase in ("in_turn", "at_once", "probes"):  # each phase on both servers, back to back
            for name in order:
                runs[name].update(run_phase(loads[name], phase, args.probes))
        for name in order:
            reps[name].append(r := runs[name])
            print(f"rep {rep + 1} {name}: {r['in_turn_tokens_per_s']:.1f} in turn, {r['at_once_tokens_per_s']:.1f} "
                  f"at once tok/s; TTFT alone {max(r['ttft_alone_s']):.2f} s, beside 3 streams "
                  f"{max(r['ttft_loaded_s']):.2f} s", flush=True)
    out = {name: summarise(runs) | {"reps": runs} for name, runs in reps.items()}
    for ours in [name for name in reps if name != "llama.cpp" and "llama.cpp" in reps]:
        out[over_llamacpp(ours)] = {key: median_ratio([r[key] for r in reps[ours]], [r[key] for r in reps["llama.cpp"]])
                                    for key in ("in_turn_tokens_per_s", "at_once_tokens_per_s")}
    return out


def over_llamacpp(name: str) -> str:
    """The key of a MoEScope server's ratios to llama.cpp ("moescope_over_llamacpp", ...)."""
    return f"{name.replace(' --', '_').replace('-', '_')}_over_llamacpp"


def expert_loads(server: Server, load: Load, repetitions: int) -> dict:
    """Measurement 3 (MoEScope's telemetry: bytes loaded into its expert cache / one expert's bytes,
    per completion token, prompts included) with 1 stream and with 4; the routing of the 4 as the server
    returned it, and its own count of the experts they shared (telemetry `sharing`) where it has one."""
    out: dict = {"1 stream": [], f"{STREAMS} streams": [], "routing": [], "sharing": [], "unavailable": None}
    for _ in range(repetitions):
        for key, phase in (("1 stream", load.in_turn), (f"{STREAMS} streams", load.at_once)):
            before = _telemetry_or_none(server, out)
            _, replies = phase(routing=True)
            after = _telemetry_or_none(server, out)
            if before and after:
                expert = after["budget_bytes"] / max(1, sum(after["slots_per_layer"]))
                loads = (after["bytes_loaded_total"] - before["bytes_loaded_total"]) / expert
                out[key].append(loads / sum(r.tokens for r in replies))
            if key != "1 stream":
                if all(r.routing for r in replies):
                    out["routing"].append([r.routing for r in replies])
                if after and after.get("sharing"):
                    out["sharing"].append(after["sharing"])
    return out


def _telemetry_or_none(server: Server, out: dict) -> dict | None:
    """The snapshot, or None with the reason kept in out["unavailable"]."""
    import httpx

    try:
        return telemetry(server)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        out["unavailable"] = f"MoEScope's /moescope/v1/telemetry failed: {type(e).__name__}: {e}"
        return None


def bound(gguf: Path, config: dict, routings: list, sharing: list[dict] | None = None) -> dict:
    """Measurement 4: the bytes one batch step of STREAMS reads against STREAMS tokens of one stream,
    from the GGUF's tensors (bench.gguf_files: token embeddings left out), with the union of experts
    random and as the server routed them."""
    from bench.gguf_files import gguf_token_bytes

    n_experts = config.get("num_experts") or config["num_local_experts"]
    top_k = config["num_experts_per_tok"]
    token = gguf_token_bytes(gguf)
    dense = token.bytes_per_token - token.expert_bytes_per_token
    expert = token.expert_bytes_per_token / top_k  # one expert in every MoE layer
    unions = {"random": expected_union(n_experts, top_k, STREAMS)}
    steps = [u for rep in routings for u in step_union(rep)]
    if steps:
        unions["routed (the server's routed_experts)"] = statistics.mean(steps)
    turns = [x for x in sharing or [] if x.get("turns")]
    if turns:  # its turns of 2 or more replies, not only of 4
        unions["MoEScope's own count (telemetry sharing)"] = statistics.mean(
            x["distinct"] / (x["turns"] * x["layers"]) for x in turns)
    return {"dense_bytes": dense, "expert_bytes_all_layers": expert, "top_k": top_k, "n_experts": n_experts,
            "one_stream_bytes_per_token": dense + top_k * expert,
            "union_per_layer": unions, "step_bytes": {k: dense + u * expert for k, u in unions.items()},
            "bound": {k: batching_bound(dense, expert, top_k, u, STREAMS) for k, u in unions.items()}}


def table(result: dict, args) -> list[str]:
    servers = [s for s in SERVERS if s in result["servers"]]
    lines = [f"Serving {STREAMS} clients at once: {args.geometry} Q4_K_M GGUF, {args.threads} threads, "
             f"`/v1/completions` streamed from the `openai` client, a fresh {args.prompt_len}-token prompt of token ids, "
             f"{args.tokens} tokens at temperature 0; median of {args.repetitions} interleaved repetitions "
             f"(p95 TTFT over all of them). Run: `{result['command']}`.", ""]
    for s in servers:
        lines.append(f"- {s}: {result['notes'][s]}")
    if not result["moescope_parallel"]:
        lines.append("- Until `moescope serve --parallel` lands, MoEScope serves the requests in turn: its 4 at once "
                     "queue behind each other, so its gain is only the idle time between requests saved, and a new "
                     "request waits for those ahead of it.")
    if result.get("cpu"):
        lines.append(f"- CPU: {result['cpu']}")
    load = result["loadavg"]
    lines.append(f"- 1-minute load average at the start / end: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores "
                 "(other work shares them: compare only the side-by-side ratios).")
    lines += ["", "| server | tok/s, 4 in turn | tok/s, 4 at once | gain (at once / in turn) "
              "| p95 TTFT alone (s) | p95 TTFT beside 3 streams (s) | beside / alone |", "|---|---|---|---|---|---|---|"]
    for s in servers:
        r = result["servers"][s]
        lines.append(f"| {s} | {r['in_turn_tokens_per_s']:.1f} | {r['at_once_tokens_per_s']:.1f} | {r['gain']:.2f} "
                     f"| {r['ttft_alone_p95_s']:.3f} | {r['ttft_loaded_p95_s']:.3f} | {r['ttft_loaded_over_alone']:.1f} |")
    for s in servers:
        if over_llamacpp(s) in result["servers"]:
            ratio = result["servers"][over_llamacpp(s)]
            lines += ["", f"{s} / llama.cpp, per repetition, median: {ratio['in_turn_tokens_per_s']:.2f} in turn, "
                      f"{ratio['at_once_tokens_per_s']:.2f} at once."]
    return lines + loads_table(result, args)


def loads_table(result: dict, args) -> list[str]:
    lines = []
    loads = result.get("expert_loads")
    if loads and not (loads["1 stream"] and loads[f"{STREAMS} streams"]):
        lines += ["", f"MoEScope's expert loads per generated token at a {args.budget} budget: n/a ({loads['unavailable']})."]
    elif loads:
        one, many = (statistics.median(loads[k]) for k in ("1 stream", f"{STREAMS} streams"))
        lines += ["", f"MoEScope at a {args.budget} budget ({result['notes']['moescope-budget']}): expert loads per "
                  f"generated token (telemetry: bytes loaded / one expert's bytes; prompts included), median: "
                  f"{one:.2f} with 1 stream, {many:.2f} with {STREAMS} at once."]
    b = result["bound"]
    measured = {s: f"{result['servers'][s]['gain']:.2f}" for s in SERVERS if s in result["servers"]}
    lines += ["", f"The bound on batching {STREAMS} streams where a step costs the weight bytes it reads (dense "
              f"{b['dense_bytes'] / 1e6:.1f} MB once, {b['expert_bytes_all_layers'] / 1e6:.2f} MB per expert across "
              f"the layers; one stream: {b['one_stream_bytes_per_token'] / 1e6:.1f} MB a token):", "",
              "| routing | experts a layer, union of 4 | MB a step of 4 | bound on the gain | measured gain |",
              "|---|---|---|---|---|"]
    for kind in b["bound"]:
        lines.append(f"| {kind} | {b['union_per_layer'][kind]:.1f} of {b['n_experts']} (top-{b['top_k']}) "
                     f"| {b['step_bytes'][kind] / 1e6:.1f} | {b['bound'][kind]:.2f} "
                     f"| {', '.join(f'{s} {g}' for s, g in measured.items())} |")
    return lines


def prepare(args) -> tuple[Path | None, Path, dict]:
    """(llama-server or None when skipped, the Q4_K_M GGUF, the checkpoint's config)."""
    from bench.gguf_files import ensure_ggufs
    from bench.llamacpp_build import SERVER, TOOLS, build_tools
    from bench.synthetic import build_checkpoint

    lc = build_tools(tools=TOOLS if args.skip_llamacpp else (*TOOLS, SERVER), isa=args.isa)
    path = Path(args.geometry) if Path(args.geometry).is_dir() else build_checkpoint(args.geometry)
    gguf = ensure_ggufs(path, ("Q4_K_M",), lc=lc)["Q4_K_M"]  # one GGUF folder serves every --isa build
    config = json.loads((path / "config.json").read_text())
    return (None if args.skip_llamacpp else lc.tool(SERVER)), gguf, config


def measure(args, server_tool: Path | None, gguf: Path, config: dict, logdir: Path) -> dict:
    from contextlib import ExitStack

    parallel = moescope_parallel_flag()
    result: dict = {"command": command_line(args), "notes": {}, "moescope_parallel": parallel}
    with ExitStack() as stack:
        servers = [stack.enter_context(moescope_server(gguf, args.threads, "all", logdir, parallel, int8))
                   for int8 in ((False, True) if args.int8 else (False,))]
        if server_tool is not None:
            servers.append(stack.enter_context(llama_server(server_tool, gguf, args.threads,
                                                            args.prompt_len + args.tokens + 64, logdir, args.isa)))
        result["notes"] = {s.name: s.note + ("; budget all, RAM store" if s.name != "llama.cpp" else "")
                           for s in servers}
        loads = {s.name: Load(s, config["vocab_size"], args.prompt_len, args.tokens, seed=i)
                 for i, s in enumerate(servers)}
        result["servers"] = side_by_side(loads, args)
    with moescope_server(gguf, args.threads, args.budget, logdir, parallel) as server:
        result["notes"]["moescope-budget"] = server.note + ", RAM store"
        # counts, not timings: one repetition
        result["expert_loads"] = expert_loads(server, Load(server, config["vocab_size"], args.prompt_len,
                                                           args.tokens, seed=7), 1)
    return result


def cpu_line() -> str:
    """The CPU in words and the kernel variant MoEScope runs on it: ratios differ by CPU."""
    from engine.decode.native.kernels import summary
    from engine.system.cpu import cpuinfo_field

    return f"{cpuinfo_field('model name') or 'unknown'}, {os.cpu_count()} cores; MoEScope's kernels {summary()}"


def command_line(args) -> str:
    return (f"python -m bench.serve_load --tokens {args.tokens} --repetitions {args.repetitions} --probes {args.probes}"
            + (" --skip-llamacpp" if args.skip_llamacpp else "") + ("" if args.int8 else " --no-int8")
            + ("" if args.isa == "native" else f" --isa {args.isa}"))


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    from bench.llamacpp_build import ISAS, LlamaCppUnavailable, hold_to_isa

    parser = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3moe-64e", help="a bench.synthetic geometry or a checkpoint folder")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request generates (default 64)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt token ids per request (default 16)")
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved repetitions, medians over them")
    parser.add_argument("--probes", type=int, default=2, help="TTFT probes beside 3 streams per repetition")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", default="50%", help="MoEScope's budget for the expert-load count (default 50%%)")
    parser.add_argument("--skip-llamacpp", action="store_true", help="MoEScope alone (no llama-server build or run)")
    parser.add_argument("--no-int8", dest="int8", action="store_false",
                        help="leave out MoEScope with --int8-inputs (llama.cpp's precision, lossy)")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="avx2: both sides held to AVX2 and FMA on a CPU that has more (MoEScope's "
                        "x86-64-v3 kernels, llama.cpp built without AVX-512, VNNI or AMX), as a laptop runs them")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    hold_to_isa(parser, args.isa)  # the servers started below run its kernel variant
    try:
        server_tool, gguf, config = prepare(args)
    except LlamaCppUnavailable as e:
        print(f"error: {e} (--skip-llamacpp measures MoEScope alone)", file=sys.stderr)
        return 2
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="moescope-serve-load-") as tmp:
        try:
            result = measure(args, server_tool, gguf, config, Path(tmp))
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):  # what the servers said, before the folder goes
                print(f"--- the end of {log.name}:\n" + "\n".join(log.read_text().splitlines()[-25:]), file=sys.stderr)
            raise
    loads = result["expert_loads"]
    result["bound"] = bound(gguf, config, loads.pop("routing"), loads["sharing"])
    result.update(loadavg=[started_load, os.getloadavg()[0]], cpu=cpu_line(), geometry=args.geometry, threads=args.threads, tokens=args.tokens, prompt_len=args.prompt_len,
                  repetitions=args.repetitions, probes=args.probes, budget=args.budget)
    write_report(args.out, KIND, result, table(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
