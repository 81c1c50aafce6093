"""Cache policies: which expert to evict, and what to fetch before it is asked for.

A policy only sees expert ids; it never touches tensors. The same policy object drives the live
cache (`engine.cache.ExpertCache`) and the trace replayer, so what a replay reports is what the
engine would do.
"""

from __future__ import annotations

from engine.policies.base import CachePolicy
from engine.policies.lru import LRUPolicy

POLICIES: dict[str, type[CachePolicy]] = {
    LRUPolicy.name: LRUPolicy,
}


def make_policy(name: str) -> CachePolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy '{name}'; choose one of: {known}") from None
