"""The chat's context meter in words: how much of the model's context the conversation fills (Qt-free)."""

from __future__ import annotations

from engine.protocol import ReplyStats

MEMORY_MARKER = "The model no longer sees the messages above"


def meter_text(used: int, context_length: int) -> str:
    """ "1,204 / 4,096 tokens"; without a model (context unknown) the count alone."""
    if context_length <= 0:
        return f"{used:,} tokens"
    return f"{used:,} / {context_length:,} tokens"


def meter_tip(used: int, context_length: int, dropped: bool) -> str:
    share = f" ({used / context_length:.0%} of the model's context)" if context_length > 0 else ""
    tip = f"The last prompt and its reply: {used:,} tokens{share}."
    if dropped:
        tip += " Older turns no longer fit: the model sees the conversation from the marked message on."
    return tip


def tokens_in_context(stats: ReplyStats | None) -> int:
    """What a finished reply left in the context: the prompt the model saw and the tokens it wrote."""
    return stats.prefill_tokens + stats.decode_tokens if stats is not None else 0
