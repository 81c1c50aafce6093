"""Prompts into ids, and replies out of them: one alone (`generate`), or a sequence advanced a
forward at a time beside others (`start`, engine.decode.sequence).

Between forwards a reply calls `between_tokens()`, where the caller applies live changes (budget,
policy) or asks to stop; text is streamed as deltas through `on_text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from engine.decode import block_diffusion
from engine.decode.context_window import FittedPrompt, fit_chat
from engine.decode.reply import Reply, ReplyTimeline, TextFn, TokenFn
from engine.decode.runtime import MoERuntime
from engine.decode.sequence import Sequence as DecodeSequence
from engine.decode.sequence import check_prompt
from engine.errors import MoEScopeError
from engine.protocol import ReplyStats, SamplingSettings


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: ReplyStats = field(default_factory=ReplyStats)
    routed_experts: np.ndarray | None = None  # with keep_routing: [steps after the prompt, layers, top_k] int16

    @classmethod
    def of(cls, sequence: DecodeSequence) -> GenerationResult:
        """A finished sequence's reply."""
        reply = sequence.reply
        return cls(reply.tokens, reply.text, reply.finish, sequence.stats(), sequence.routing())

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason, "stats": asdict(self.stats)}


class Generator:
    def __init__(self, runtime: MoERuntime) -> None:
        self.runtime = runtime

    # ----- prompts -----
    def _tokenizer(self):
        if self.runtime.tokenizer is None:
            raise MoEScopeError("this checkpoint has no tokenizer files; pass token ids with --prompt-ids")
        return self.runtime.tokenizer

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        tok = self._tokenizer()
        if not getattr(tok, "chat_template", None):
            raise MoEScopeError("this model's tokenizer has no chat template; use --raw for plain text prompts")
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def fit_chat(self, messages: Sequence[dict], settings: SamplingSettings, overflow: str) -> FittedPrompt:
        """The chat's prompt within this model's context under the `overflow` policy
        (engine.decode.context_window): older turns left out, or PromptTooLongError naming the length."""
        return fit_chat(self.encode_chat, messages, self.runtime.context_length, settings.max_new_tokens, overflow)

    def encode_raw(self, text: str) -> list[int]:
        return list(self._tokenizer()(text, add_special_tokens=True)["input_ids"])

    def eos_ids(self) -> set[int]:
        """Stop tokens exactly as transformers' generate picks them: the generation config's, else the
        model config's. (Not the tokenizer's: generate does not look there either.)"""
        vocab = self.runtime.model.config.get_text_config().vocab_size
        for source in (getattr(self.runtime.model, "generation_config", None), self.runtime.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids = {value} if isinstance(value, int) else set(value or [])
            if ids:
                return {i for i in ids if 0 <= i < vocab}
        return set()

    # ----- the loop -----
    def start(self, prompt_ids: Sequence[int], settings: SamplingSettings, *, on_text: TextFn | None = None,
              on_token: TokenFn | None = None, between_tokens: Callable[[], bool] | None = None,
              keep_routing: bool = False) -> DecodeSequence:
        """A reply to `prompt_ids` that runs a forward per `step()` (engine.decode.sequence), for a
        caller that advances several in turn; refused at once if it cannot run."""
        return DecodeSequence(self.runtime, prompt_ids, settings, self.eos_ids(), on_text=on_text, on_token=on_token,
                              between_tokens=between_tokens, keep_routing=keep_routing,
                              chunk_tokens=self.runtime.prefill_chunk_tokens)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings,
        *,
        on_text: TextFn | None = None,
        on_token: TokenFn | None = None,
        between_tokens: Callable[[], bool] | None = None,
        keep_routing: bool = False,
        on_draft: TextFn | None = None,
    ) -> GenerationResult:
        """One reply, alone: the prompt, then token by token (or a block-diffusion model's blocks)."""
        rt = self.runtime
        check_prompt(prompt_ids, settings, rt.context_length)
        rt.counters.start_request()
        rt.cache.policy.on_request_start()
        if rt.block_diffusion:
            return self._denoise_blocks(prompt_ids, settings, on_text, on_token, between_tokens, on_draft)
        sequence = self.start(prompt_ids, settings, on_text=on_text, on_token=on_token,
                              between_tokens=between_tokens, keep_routing=keep_routing)
        while sequence.step():
            pass
        return GenerationResult.of(sequence)

    def _denoise_blocks(self, prompt_ids: Sequence[int], settings: SamplingSettings, on_text: TextFn | None,
                        on_token: TokenFn | None, between_tokens: Callable[[], bool] | None,
                        on_draft: TextFn | None) -> GenerationResult:
        """A block-diffusion model's own loop (engine.decode.block_diffusion): each denoising forward is
        one step for the counters, and its draft of the block (the most likely token at each place, up
        to the reply's length limit) goes to `on_draft`; each finished block enters the reply token by
        token. No per-token routing to return: a block's forwards route a whole canvas at a time."""
        rt = self.runtime
        rt.decode_path, rt.decode_path_reason = block_diffusion.LABEL, block_diffusion.REASON
        limit = min(settings.max_new_tokens, rt.context_length - len(prompt_ids))
        reply = Reply(rt.tokenizer, self.eos_ids(), settings.stop, limit, on_text, on_token, between_tokens)
        timeline = ReplyTimeline()
        blocks = 0

        def on_step(draft: torch.Tensor) -> bool:
            timeline.add(rt.counters.end_token())
            rt.cache.policy.on_token_end()
            if on_draft is not None and rt.tokenizer is not None:
                on_draft(rt.tokenizer.decode(draft[0, : reply.limit - len(reply.tokens)].tolist(),
                                             skip_special_tokens=True))
            return reply.interrupted()

        def on_block() -> None:
            nonlocal blocks
            if blocks == 0:
                timeline.first_token_out(whole_blocks=True)
            blocks += 1

        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=rt.device)
        streamer = block_diffusion.BlockStreamer(on_step, reply.take, on_block)
        block_diffusion.denoise(rt.model, ids, block_diffusion.seed_for(settings.temperature, settings.seed),
                                reply.limit, streamer)
        stats = timeline.stats(len(prompt_ids), len(reply.tokens), rt.cache.budget_bytes)
        return GenerationResult(reply.tokens, reply.text, reply.finish, stats)
