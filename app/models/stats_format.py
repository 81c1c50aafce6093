"""Short human text for sizes, rates and a reply's statistics (Qt-free)."""

from __future__ import annotations

from engine.accounting.sizes import format_bytes
from engine.protocol import ReplyStats

__all__ = ["format_bytes", "format_rate", "reply_stats_line"]


def format_rate(bytes_per_s: float) -> str:
    return format_bytes(bytes_per_s) + "/s"


def reply_stats_line(stats: ReplyStats) -> str:
    """prefill and decode tokens/s, TTFT and hit rate, as shown under each reply."""
    parts = []
    if stats.prefill_tokens:
        parts.append(f"prefill {stats.prefill_tokens_per_s:.1f} tok/s")
    parts.append(f"decode {stats.decode_tokens_per_s:.1f} tok/s")
    parts.append(f"TTFT {stats.ttft_s * 1000:.0f} ms" if stats.ttft_s < 1 else f"TTFT {stats.ttft_s:.2f} s")
    if stats.hits or stats.misses:  # a remote engine has no cache of ours to hit
        parts.append(f"hit rate {stats.hit_rate:.1%}")
    if stats.decode_tokens:
        parts.append(f"{stats.decode_tokens} tokens")
    return " · ".join(parts)
