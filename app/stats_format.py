"""Short human text for sizes, rates and a reply's statistics (Qt-free)."""

from __future__ import annotations

from engine.sizes import format_bytes

__all__ = ["format_bytes", "format_rate", "reply_stats_line"]


def format_rate(bytes_per_s: float) -> str:
    return format_bytes(bytes_per_s) + "/s"


def reply_stats_line(stats: dict) -> str:
    """prefill and decode tokens/s, TTFT and hit rate, as shown under each reply."""
    parts = []
    if stats.get("prefill_tokens"):
        parts.append(f"prefill {stats.get('prefill_tokens_per_s', 0.0):.1f} tok/s")
    parts.append(f"decode {stats.get('decode_tokens_per_s', 0.0):.1f} tok/s")
    parts.append(f"TTFT {stats.get('ttft_s', 0.0) * 1000:.0f} ms" if stats.get("ttft_s", 0.0) < 1
                 else f"TTFT {stats.get('ttft_s', 0.0):.2f} s")
    if "hit_rate" in stats:
        parts.append(f"hit rate {stats['hit_rate']:.1%}")
    if stats.get("decode_tokens"):
        parts.append(f"{stats['decode_tokens']} tokens")
    return " · ".join(parts)
