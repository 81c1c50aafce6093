"""Cache policies: which expert to evict, and what to fetch before it is asked for.

A policy only sees expert ids; it never touches tensors. The same policy object drives the live
cache (`engine.offload.expert_cache.ExpertCache`) and the trace replayer, so what a replay reports is what the
engine would do. Options go after a colon: `promoe:k=3`, `eam:collection_size=64,depth=2`.
"""

from __future__ import annotations

from engine.accounting.policies.base import CachePolicy
from engine.accounting.policies.crosslayer import CrossLayerPolicy
from engine.accounting.policies.eam import EAMPolicy
from engine.accounting.policies.lfu import LFUPolicy
from engine.accounting.policies.lru import LRUPolicy
from engine.accounting.policies.markov import MarkovPolicy
from engine.accounting.policies.popularity import PopularityPolicy
from engine.accounting.policies.promoe import ProMoEPolicy
from engine.accounting.policies.swapmoe import SwapMoEPolicy
from engine.errors import MoEScopeError

POLICIES: dict[str, type[CachePolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, MarkovPolicy, CrossLayerPolicy, PopularityPolicy, EAMPolicy, ProMoEPolicy, SwapMoEPolicy)
}
LOSSLESS = [name for name, cls in POLICIES.items() if cls.lossless]


class PolicyError(MoEScopeError, ValueError):
    kind = "bad-policy"


def parse_policy(spec: str) -> tuple[str, dict[str, float | int | str]]:
    """`name` or `name:key=value,key=value` -> (name, options)."""
    name, _, rest = spec.strip().partition(":")
    if name not in POLICIES:
        known = ", ".join(POLICIES)
        raise PolicyError(f"unknown policy '{name}'; choose one of: {known}")
    options: dict[str, float | int | str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise PolicyError(f"policy option '{item}' needs a value, e.g. {name}:{item}=2")
        options[key.strip()] = _number(value.strip())
    return name, options


def _number(text: str) -> float | int | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def make_policy(spec: str) -> CachePolicy:
    name, options = parse_policy(spec)
    try:
        return POLICIES[name](**options)
    except TypeError:
        raise PolicyError(f"policy '{name}' does not take the options {sorted(options)}") from None
