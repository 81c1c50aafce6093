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
from engine.process.library_service import LibraryService


class Worker:
    def __init__(self, conn) -> None:
        self.conn = conn
        self.runtime = None
        self.generator = None
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
            self._generate(command)
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
        elif isinstance(command, (p.SetFastDecode, p.SetInt8Prompt)):
            if isinstance(command, p.SetFastDecode):
                runtime.set_fast_decode(command.enabled)
            else:
                runtime.int8_prompt = command.enabled
            self.send(p.FastDecodeChanged(runtime.fast_decode_on, runtime.fast_decode_available, runtime.int8_prompt))
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
            int8_prompt=runtime.int8_prompt,
            kernels=native_kernels.summary(), kernels_note=native_kernels.passed_over_text(),
            expert_format=runtime.format_names[0], dense_format=runtime.format_names[1],
            overhead_bytes=runtime.overhead.total_bytes, baseline_rss_bytes=runtime.overhead.baseline_bytes,
            dense_resident_bytes=runtime.overhead.dense_bytes, text_only=info.text_only,
            load_notes=runtime.load_notes(),
        ))
        self._snapshot(force=True)

    def _unload(self) -> None:
        if self.runtime is None:
            return
        self.runtime.close()
        self.runtime = self.generator = self.telemetry = None
        # The model's modules and the cache refer to each other: only the cycle collector frees them, and
        # without this the next model would load beside the last one's weights.
        gc.collect()

    def _generate(self, command: p.Generate) -> None:
        runtime = self._require_model()
        generator = self.generator
        settings = command.sampling
        rid = command.request_id
        first_message = dropped = 0
        if command.prompt_ids is not None:
            prompt_ids = list(command.prompt_ids)
        elif command.messages is not None:
            # older turns left out here, once for every client; a message too long alone is refused before
            # anything runs
            fitted = generator.fit_chat(command.messages, settings, command.context_overflow)
            prompt_ids, first_message, dropped = fitted.ids, fitted.first_message, fitted.dropped_messages
        elif command.prompt is not None:
            prompt_ids = generator.encode_raw(command.prompt)
        else:
            raise MoEScopeError("a request needs messages, a prompt or prompt ids")
        if len(prompt_ids) < runtime.context_length:  # else the generation loop refuses it
            self.send(p.PromptContext(rid, len(prompt_ids), runtime.context_length, first_message, dropped))
        self.clock.start(rid, len(prompt_ids))
        runtime.counters.start_request()
        self.state = "prefill"
        self._snapshot(force=True)
        token_ids: list[int] = []

        def on_token(token: int) -> None:
            self.state = "decoding"
            self.clock.token()
            token_ids.append(token)

        def on_text(delta: str) -> None:
            self.send(p.Token(rid, delta, token_ids[-1:]))

        def between_tokens() -> bool:
            self._snapshot()
            return self._poll_during(rid)

        def on_draft(text: str) -> None:
            self.state = "decoding"
            self.send(p.Draft(rid, text))

        try:
            result = generator.generate(prompt_ids, settings, on_text=on_text, on_token=on_token,
                                        between_tokens=between_tokens, keep_routing=command.return_routing,
                                        on_draft=None if p.is_api_request(rid) else on_draft)
        finally:
            self.state = "idle"
        self._snapshot(force=True)
        routed = p.Array.of(result.routed_experts) if result.routed_experts is not None else None
        self.send(p.Done(rid, result.finish_reason, result.text, result.token_ids, result.stats, routed))

    def _poll_during(self, request_id: str) -> bool:
        """Apply what arrived while generating; True means stop this reply."""
        stop = False
        while self.conn.poll(0):
            command = self._receive()
            if command is None:
                self.pending.append(p.Shutdown())
                return True
            if isinstance(command, p.Cancel):
                stop = stop or command.request_id in (None, request_id)
                self._drop_queued(command.request_id)
            elif isinstance(command, (p.SetBudget, p.SetPolicy, p.SetFastDecode, p.SetInt8Prompt, p.SetTelemetry)):
                try:
                    self._apply_live(command)
                except Exception as exc:
                    self._report(exc, request_id)
            elif isinstance(command, (p.DownloadModel, p.CancelDownload, p.ListLibrary)):
                # at once: downloads run on their own thread, the listing reads local files (search and
                # estimates, which ask the Hub or build a model skeleton, wait for the reply to end)
                try:
                    self.library.handle(command)
                except Exception as exc:
                    self._report(exc, command.request_id)
            else:  # a new request, a load, an unload or a shutdown waits for this reply to stop
                if isinstance(command, (p.LoadModel, p.Unload, p.Shutdown)):
                    stop = True
                self.pending.append(command)
        return stop

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
            self.send(self.telemetry.snapshot(self.state, self.clock))
