"""`moescope chat`: a conversation in the terminal that keeps going past the model's context.

As in the window, the engine's fitting (engine.decode.context_window) decides what the model sees:
by default the oldest turns are left out (a one-line note says so), a message too long alone is
refused with its length and the chat goes on. /exit, /quit or Ctrl-D end it.
"""

from __future__ import annotations

import sys

from engine.errors import ContextFullError, PromptTooLongError
from engine.protocol import CONTEXT_OVERFLOW, SamplingSettings

EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = ("/exit or /quit (or Ctrl-D) ends the chat; /context drop-oldest|stop sets what happens when the history "
        "outgrows the model's context; /help shows this")


def note(text: str) -> None:
    print(f"moescope: {text}", file=sys.stderr, flush=True)


class TerminalChat:
    def __init__(self, runtime, settings: SamplingSettings, system: str | None, overflow: str) -> None:
        from engine.decode.generation import Generator

        self.runtime, self.settings, self.overflow = runtime, settings, overflow
        self.generator = Generator(runtime)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.dropped = 0  # messages the model no longer saw in the last prompt

    def run(self) -> int:
        info = self.runtime.info()
        print(f"{info.name}: {info.num_experts} experts x {info.num_moe_layers} MoE layers, budget "
              f"{self.runtime.cache.budget_bytes / 2**20:.0f} MiB, context {self.runtime.context_length:,} tokens. "
              "/exit, /quit or Ctrl-D ends the chat; /help lists the commands.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text):
                    return 0
            else:
                self.say(line)

    def command(self, text: str) -> bool:
        """Carry out a /command; True when it ends the chat."""
        word, _, rest = text.partition(" ")
        if word in EXIT_COMMANDS:
            return True
        if word == "/context" and rest.strip() in CONTEXT_OVERFLOW:
            self.overflow = rest.strip()
            note(f"when the history outgrows the context: {self.overflow}")
        elif word == "/context":
            note(f"/context takes {' or '.join(CONTEXT_OVERFLOW)} (now {self.overflow})")
        elif word == "/help":
            note(HELP)
        else:
            note(f"unknown command {word}; {HELP}")
        return False

    def say(self, text: str) -> None:
        """One turn: fit the history, stream the reply, remember both. A refused message is not kept."""
        self.messages.append({"role": "user", "content": text})
        try:
            fitted = self.generator.fit_chat(self.messages, self.settings, self.overflow)
        except PromptTooLongError as exc:
            self.messages.pop()
            note(str(exc))
            if isinstance(exc, ContextFullError):
                note("/context drop-oldest lets the chat go on without its oldest turns")
            return
        if fitted.dropped_messages > self.dropped:
            note(f"the model no longer sees the {fitted.dropped_messages} oldest messages: they outgrew its "
                 f"{self.runtime.context_length:,}-token context")
        self.dropped = fitted.dropped_messages
        try:
            result = self.generator.generate(fitted.ids, self.settings, on_text=lambda d: print(d, end="", flush=True))
        except KeyboardInterrupt:
            print("\n[stopped]", file=sys.stderr)
            self.messages.pop()
            return
        print()
        self.messages.append({"role": "assistant", "content": result.text})
        s = result.stats
        used = s.prefill_tokens + s.decode_tokens  # what the window's context meter shows
        print(f"[{s.decode_tokens_per_s:.1f} tok/s, hit rate {s.hit_rate:.1%}, context {used:,} / "
              f"{self.runtime.context_length:,} tokens]", file=sys.stderr, flush=True)


def run_chat(runtime, settings: SamplingSettings, system: str | None, overflow: str) -> int:
    try:
        return TerminalChat(runtime, settings, system, overflow).run()
    finally:
        runtime.close()
