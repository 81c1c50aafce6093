"""Small pure pieces: budget parsing, the cache directory with LRU, the uniform planner."""

from __future__ import annotations

import pytest

from engine.accounting.directory import CacheDirectory
from engine.accounting.planner import uniform_allocation
from engine.accounting.policies import make_policy
from engine.accounting.routing import RoutingStep
from engine.accounting.sizes import parse_budget
from engine.errors import BudgetError


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("100", 100), ("64 kib", 65536)],
)
def test_sizes(text, nbytes):
    assert parse_budget(text).resolve_bytes(10**12, 1) == nbytes


def test_relative_budgets():
    assert parse_budget("25%").resolve_bytes(1000, 10) == 250
    assert parse_budget("all").resolve_bytes(1000, 10) == 1000
    assert parse_budget("64slots").resolve_bytes(10**6, 10) == 640


@pytest.mark.parametrize("bad", ["lots", "-5%", "150%", "0slots", "12 parsecs"])
def test_bad_budgets_are_named(bad):
    with pytest.raises(BudgetError, match=bad.split()[0]):
        parse_budget(bad)


def test_lru_directory_evicts_least_recently_used():
    policy = make_policy("lru")
    policy.reset(1, 8, 2)
    d = CacheDirectory([3], policy)
    misses_per_access = []
    for experts in ([0, 1], [2], [0], [3], [1]):
        misses = d.lookup(RoutingStep.of_layer(0, experts))[0].missing
        for e in misses:
            d.assign(0, e, set(experts))
        misses_per_access.append(misses)
    # [0,1] miss; [2] miss (fills slot 3); [0] hit; [3] evicts 1 (LRU); [1] misses again, evicting 2.
    assert misses_per_access == [[0, 1], [2], [], [3], [1]]
    assert d.resident(0) == [0, 1, 3]


def test_protected_experts_are_never_evicted():
    policy = make_policy("lru")
    policy.reset(1, 8, 2)
    d = CacheDirectory([2], policy)
    d.lookup(RoutingStep.of_layer(0, [0, 1]))
    d.assign(0, 0, {0, 1})
    d.assign(0, 1, {0, 1})
    _, evicted = d.assign(0, 5, {0})
    assert evicted == 1


def test_resize_keeps_most_recent():
    policy = make_policy("lru")
    policy.reset(1, 8, 2)
    d = CacheDirectory([4], policy)
    for e in range(4):
        d.lookup(RoutingStep.of_layer(0, [e]))
        d.assign(0, e, {e})
    d.resize([2])
    assert d.resident(0) == [2, 3]
    assert sorted(d.expert_in[0]) == [2, 3]


def test_uniform_allocation_respects_floor_and_ceiling():
    assert uniform_allocation(10, 4, 2, 8) == [3, 3, 2, 2]
    assert uniform_allocation(1, 4, 2, 8) == [2, 2, 2, 2]
    assert uniform_allocation(1000, 4, 2, 8) == [8, 8, 8, 8]
