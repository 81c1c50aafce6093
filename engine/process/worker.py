"""The engine process: a command loop around one loaded model.

Commands arrive on a pipe. While a reply is being generated, the loop keeps reading between
tokens, so Cancel / SetBudget / SetPolicy / SetTelemetry take effect before the next token, not
after the reply. Every failure becomes an `Error` event; the process only dies if it is killed.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from collections import deque

from engine import protocol as p
from engine.errors import MoEScopeError
from engine.process.batch import Batch, Stream
from engine.process.library_service import LibraryService


class Worker:
    def __init__(self, conn) -> None:
        self.conn = conn
        self.runtime = None
        self.generator = None
        self.batch = Batch(1, 0)  # the replies decoding now (engine.process.batch); sized at each load
        self.pending: deque = deque()
        self.started = time.perf_counter()
        self.telemetry_enabled = True
        self.telemetry_interval = 0.1
        self.telemetry = None
        self.clock = None
        self._last_snapshot = 0.0
        self.state = "idle"  # idle | loading | prefill | decoding
        self._send_lock = threading.Lock()  # the library's download thread sends too
        self.library = LibraryService(self.send)  # model library commands (engine/library_service.py)

    # ----- plumbing -----
    def send(self, event) -> None:
        with self._send_lock:
            self.conn.send(event)

    def run(self) -> None:
        import torch

        from engine.process.telemetry import ReplyClock

        torch.set_grad_enabled(False)
        self.clock = ReplyClock()
        self.send(p.EngineStarted(os.getpid()))
        while True:
            if self.batch:
                self._turn()
                continue
            command = self.pending.popleft() if self.pending else self._receive()
            if command is None or isinstance(command, p.Shutdown):
                break
            try:
                self.handle(command)
            except Exception as exc:  # the engine stays up; the GUI shows the message
                self._report(exc, getattr(command, "request_id", None))
        self.library.close()
        self._unload()

    def _receive(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None  # the GUI went away

    def _report(self, exc: BaseException, request_id: str | None) -> None:
        import torch

        if isinstance(exc, MoEScopeError):
            self.send(p.Error(exc.kind, str(exc), True, request_id))
        elif isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            self.send(p.Error("out-of-memory", "the engine ran out of memory; lower the budget or use a smaller "
                              "model (the model is still loaded)", True, request_id))
        else:
            self.send(p.Log("error", traceback.format_exc()))
            self.send(p.Error("internal", f"{type(exc).__name__}: {exc}", True, request_id))

    # ----- commands -----
    def handle(self, command) -> None:
        if isinstance(command, p.LoadModel):
            self._load(command)
        elif isinstance(command, p.Generate):
            self._start(command)
        elif isinstance(command, p.Unload):
            self._unload()
        elif isinstance(command, p.Cancel):
            pass  # nothing is running
        elif isinstance(command, p.LIBRARY_COMMANDS):
            self.library.handle(command)
        else:
            self._apply_live(command)

    def _apply_live(self, command) -> None:
        """Commands that apply between tokens, or at once when idle."""
        if isinstance(command, p.SetTelemetry):
            self.telemetry_enabled, self.telemetry_interval = command.enabled, command.interval_s
            return
        runtime = self._require_model()
        if isinstance(command, p.SetBudget):
            plan = runtime.set_budget(command.budget)
            self.send(p.BudgetChanged(command.budget, plan.budget_bytes, plan.slots_per_layer, plan.note))
        elif isinstance(command, p.SetPolicy):
            from engine.accounting.policies import POLICIES, parse_policy

            try:
                runtime.set_policy(command.policy)
            except ValueError as exc:
                raise MoEScopeError(str(exc)) from None
            name, _ = parse_policy(command.policy)  # "promoe:k=3" -> "promoe"
            self.send(p.PolicyChanged(command.policy, POLICIES[name].lossless))
        elif isinstance(command, (p.SetFastDecode, p.SetInt8Inputs)):
            if isinstance(command, p.SetFastDecode):
                runtime.set_fast_decode(command.enabled)
            else:
                runtime.int8_inputs = command.enabled
            self.send(p.FastDecodeChanged(runtime.fast_decode_on, runtime.fast_decode_available, runtime.int8_inputs))
        self._snapshot(force=True)  # the panels show the change at once, even mid-reply

    def _require_model(self):
        if self.runtime is None:
            raise MoEScopeError("no model is loaded; load one first")
        return self.runtime

    def _load(self, command: p.LoadModel) -> None:
        from engine.accounting.policies import POLICIES
        from engine.decode.generation import Generator
        from engine.decode.native import kernels as native_kernels
        from engine.decode.runtime import MoERuntime
        from engine.process.telemetry import TelemetryBuilder

        self._unload()
        self.send(p.LoadProgress(0.0, f"opening {command.path}"))
        self.state = "loading"
        try:
            runtime = MoERuntime(command, progress=lambda f, what: self.send(p.LoadProgress(f, what)))
        finally:
            self.state = "idle"

        self.runtime, self.generator = runtime, Generator(runtime)
        self.batch = _batch_for(command, runtime)
        self.telemetry = TelemetryBuilder(runtime, self.started)
        info = runtime.info()
        self.send(p.LoadProgress(1.0, "ready"))
        self.send(p.ModelLoaded(
            name=info.name, path=info.path, architecture=info.architecture, num_layers=info.num_moe_layers,
            num_experts=info.num_experts, top_k=info.top_k, expert_bytes=info.expert_bytes,
            all_expert_bytes=info.all_expert_bytes, dense_bytes=info.dense_bytes,
            min_budget_bytes=info.min_budget_bytes, max_budget_bytes=info.max_budget_bytes,
            budget_bytes=runtime.cache.budget_bytes, slots_per_layer=runtime.cache.slots_per_layer,
            device=info.device, store=info.store, dtype=info.dtype, context_length=info.context_length,
            policy=runtime.cache.policy.name,
            policies=[p.PolicyInfo(name, cls.lossless, cls.description) for name, cls in POLICIES.items()],
            load_seconds=runtime.load_seconds, budget_note=runtime.plan.note,
            fast_decode=runtime.fast_decode_on, fast_decode_available=runtime.fast_decode_available,
            int8_inputs=runtime.int8_inputs,
            kernels=native_kernels.summary(), kernels_note=native_kernels.passed_over_text(),
            expert_format=runtime.format_names[0], dense_format=runtime.format_names[1],
            overhead_bytes=runtime.overhead.total_bytes, baseline_rss_bytes=runtime.overhead.baseline_bytes,
            dense_resident_bytes=runtime.overhead.dense_bytes, text_only=info.text_only,
            load_notes=runtime.load_notes(), parallel=self.batch.parallel,
        ))
        self._snapshot(force=True)

    def _unload(self) -> None:
        if self.runtime is None:
            return
        self.runtime.close()
        self.runtime = self.generator = self.telemetry = None
        self.batch = Batch(1, 0)  # the last model's end of a step holds its runtime
        # The model's modules and the cache refer to each other: only the cycle collector frees them, and
        # without this the next model would load beside the last one's weights.
        gc.collect()

    def _prompt_ids(self, command: p.Generate) -> list[int]:
        """The request's prompt as token ids; the PromptContext event says how it fits the context."""
        runtime, generator = self._require_model(), self.generator
        first_message = dropped = 0
        if command.prompt_ids is not None:
            prompt_ids = list(command.prompt_ids)
        elif command.messages is not None:
            # older turns left out here, once for every client; a message too long alone is refused before
            # anything runs
            fitted = generator.fit_chat(command.messages, command.sampling, command.context_overflow)
            prompt_ids, first_message, dropped = fitted.ids, fitted.first_message, fitted.dropped_messages
        elif command.prompt is not None:
            prompt_ids = generator.encode_raw(command.prompt)
        else:
            raise MoEScopeError("a request needs messages, a prompt or prompt ids")
        if len(prompt_ids) < runtime.context_length:  # else the sequence refuses it
            self.send(p.PromptContext(command.request_id, len(prompt_ids), runtime.context_length, first_message,
                                      dropped))
        return prompt_ids

    def _start(self, command: p.Generate) -> None:
        """Open a reply in the batch (it runs in the next turns), or run a block-diffusion model's alone."""
        runtime = self._require_model()
        prompt_ids = self._prompt_ids(command)
        if runtime.block_diffusion:
            self._generate_alone(command, prompt_ids)
            return
        from engine.process.telemetry import ReplyClock

        rid, clock = command.request_id, ReplyClock()
        token_ids: list[int] = []

        def on_token(token: int) -> None:
            clock.token()
            token_ids.append(token)

        def on_text(delta: str) -> None:
            self.send(p.Token(rid, delta, token_ids[-1:]))

        sequence = self.generator.start(prompt_ids, command.sampling, on_text=on_text, on_token=on_token,
                                        keep_routing=command.return_routing)
        clock.start(rid, len(prompt_ids))
        if not self.batch:  # a batch starts: the panels' "this reply" figures count from here
            runtime.counters.start_request()
            runtime.cache.policy.on_request_start()
        self.batch.add(Stream(rid, sequence, clock))
        self.clock = self.batch.streams[0].clock
        self.state = self.batch.state  # not "idle" beside a reply that has started
        self._snapshot(force=True)

    def _turn(self) -> None:
        """Apply what arrived, open the replies that have room, then one forward of every open reply."""
        for request_id in self._poll():
            self.batch.cancel(request_id)
        self._admit()
        self.state = self.batch.state
        self.batch.turn(self._finished, self._failed)
        if self.batch:
            self.clock = self.batch.streams[0].clock
            self._snapshot()
        else:
            self.state = "idle"

    def _admit(self) -> None:
        """Requests waiting in order open while the batch has room; the window's chat goes ahead of the
        server's. Anything else waiting (a load, a library search) waits for the batch to end."""
        for command in [c for c in self.pending if isinstance(c, p.Generate) and not p.is_api_request(c.request_id)]:
            if self.batch.has_room(command.request_id):
                self.pending.remove(command)
                self._open(command)
        while self.pending and isinstance(self.pending[0], p.Generate) and self.batch.has_room(self.pending[0].request_id):
            self._open(self.pending.popleft())

    def _open(self, command: p.Generate) -> None:
        try:
            self._start(command)
        except Exception as exc:
            self._report(exc, command.request_id)

    def _finished(self, stream: Stream) -> None:
        from engine.decode.generation import GenerationResult

        result = GenerationResult.of(stream.sequence)
        if not self.batch:
            self.state = "idle"
        self._snapshot(force=True)  # the panels hold the reply's last figures when its Done arrives
        routed = p.Array.of(result.routed_experts) if result.routed_experts is not None else None
        self.send(p.Done(stream.request_id, result.finish_reason, result.text, result.token_ids, result.stats, routed))

    def _failed(self, stream: Stream, exc: Exception) -> None:
        self._report(exc, stream.request_id)

    def _generate_alone(self, command: p.Generate, prompt_ids: list[int]) -> None:
        """A block-diffusion model's reply: its own loop, alone, commands applied between its forwards."""
        rid = command.request_id
        self.clock.start(rid, len(prompt_ids))
        self.state = "prefill"
        self._snapshot(force=True)

        def on_token(token: int) -> None:
            self.state = "decoding"
            self.clock.token()

        def between_tokens() -> bool:
            self._snapshot()
            cancelled = self._poll()
            return None in cancelled or rid in cancelled

        def on_draft(text: str) -> None:
            self.state = "decoding"
            self.send(p.Draft(rid, text))

        try:
            result = self.generator.generate(
                prompt_ids, command.sampling, on_text=lambda delta: self.send(p.Token(rid, delta, [])),
                on_token=on_token, between_tokens=between_tokens,
                on_draft=None if p.is_api_request(rid) else on_draft)
        finally:
            self.state = "idle"
        self._snapshot(force=True)
        self.send(p.Done(rid, result.finish_reason, result.text, result.token_ids, result.stats))

    def _poll(self) -> set[str | None]:
        """Apply what arrived while replies run; the request ids to cancel (None: every reply)."""
        cancelled: set[str | None] = set()
        while self.conn.poll(0):
            command = self._receive()
            if command is None:
                self.pending.append(p.Shutdown())
                return {None}
            if isinstance(command, p.Cancel):
                cancelled.add(command.request_id)
                self._drop_queued(command.request_id)
            elif isinstance(command, (p.SetBudget, p.SetPolicy, p.SetFastDecode, p.SetInt8Inputs, p.SetTelemetry)):
                try:
                    self._apply_live(command)
                except Exception as exc:
                    self._report(exc, None)
            elif isinstance(command, (p.DownloadModel, p.CancelDownload, p.ListLibrary)):
                # at once: downloads run on their own thread, the listing reads local files (search and
                # estimates, which ask the Hub or build a model skeleton, wait for the replies to end)
                try:
                    self.library.handle(command)
                except Exception as exc:
                    self._report(exc, command.request_id)
            else:  # a new request waits for room; a load, an unload or a shutdown stops every reply first
                if isinstance(command, (p.LoadModel, p.Unload, p.Shutdown)):
                    cancelled.add(None)
                self.pending.append(command)
        return cancelled

    def _drop_queued(self, request_id: str | None) -> None:
        """A Cancel for a request still waiting behind the running one: it never starts (the server's
        clients that disconnect while queued)."""
        if request_id is None:
            return
        for queued in [c for c in self.pending if isinstance(c, p.Generate) and c.request_id == request_id]:
            self.pending.remove(queued)
            self.send(p.Done(request_id, "cancelled", "", [], p.ReplyStats()))

    def _snapshot(self, force: bool = False) -> None:
        if not self.telemetry_enabled or self.telemetry is None:
            return
        now = time.perf_counter()
        if force or now - self._last_snapshot >= self.telemetry_interval:
            self._last_snapshot = now
            snapshot = self.telemetry.snapshot(self.state, self.clock)
            snapshot.streams = [stream.info() for stream in self.batch.streams]
            snapshot.sharing = self.batch.sharing.snapshot()
            self.send(snapshot)


def _batch_for(command: p.LoadModel, runtime) -> Batch:
    """The loaded model's batch: its size, and whether one-token forwards, and new prompts, run together."""
    parallel = _parallel(command, runtime)
    return Batch(parallel, runtime.counters.num_layers, parallel > 1, lambda: runtime.counters.end_token(),
                 pack_prompts=parallel > 1)


def _parallel(command: p.LoadModel, runtime) -> int:
    """LoadModel.parallel, or (0) as many replies as the memory left after the load holds."""
    import psutil

    from engine.hub.estimate import kv_cache_bytes_per_token, parallel_for

    per_token = kv_cache_bytes_per_token(runtime.model.config, runtime.dtype.itemsize)
    return parallel_for(command.parallel, per_token, runtime.context_length, psutil.virtual_memory().available)
