"""The serving load bench's statistics (bench.serve_load), on fixed numbers: the bench itself is slow
and runs by hand."""

import pytest

from bench.serve_load import batching_bound, expected_union, median_ratio, percentile, step_union


def test_percentile_interpolates_between_the_sorted_values():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 95)


def test_ratios_are_taken_per_repetition_then_the_median():
    assert median_ratio([10.0, 30.0, 8.0], [5.0, 10.0, 8.0]) == 2.0  # 2, 3, 1
    with pytest.raises(ValueError):
        median_ratio([1.0], [1.0, 2.0])


def test_random_routing_union_of_streams():
    assert expected_union(64, 8, 1) == pytest.approx(8)
    assert expected_union(64, 8, 4) == pytest.approx(64 * (1 - (7 / 8) ** 4))  # 26.5 of 64
    assert expected_union(8, 8, 4) == 8


def test_step_union_counts_distinct_experts_per_layer_at_each_step():
    a = [[[0, 1], [2, 3]], [[0, 1], [4, 5]]]  # [tokens, layers, top_k]
    b = [[[0, 2], [2, 3]], [[6, 7], [4, -1]]]  # -1 pads
    assert step_union([a, b]) == [(3 + 2) / 2, (4 + 2) / 2]
    assert step_union([a, b[:1]]) == [2.5]  # the steps both reached


def test_batching_bound_counts_dense_weights_once_and_the_union_of_experts():
    # one stream: 100 dense + 8 experts of 10 = 180 a token; a step of 4 reads 100 + 20 x 10 = 300
    assert batching_bound(100, 10, 8, 20, 4) == pytest.approx(4 * 180 / 300)
    assert batching_bound(100, 10, 8, 8, 4) == pytest.approx(4)  # the same experts: dense and experts read once
    assert batching_bound(0, 10, 8, 32, 4) == pytest.approx(1)  # experts only, disjoint: no gain
