"""Comparator networks (robustagg.functional.network) checked by the 0-1 principle.

A comparator network puts the p-th order statistic at position p for every input iff it does for
every 0-1 input (Knuth, TAOCP 3, 5.3.4); the same holds for "the multiset at these positions", by
thresholding. So all 2^n 0-1 inputs are tried for n <= 16 (vectorised over inputs), and random
0-1 and real inputs above that.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from robustagg.functional.network import batcher_network, pairwise_network, prune, selection_network


def _apply(network, columns: np.ndarray) -> np.ndarray:
    """Run the network on every column of ``columns`` (n, m) at once."""
    v = columns.copy()
    for i, j in network:
        lo, hi = np.minimum(v[i], v[j]), np.maximum(v[i], v[j])
        v[i], v[j] = lo, hi
    return v


def _all_01(n: int) -> np.ndarray:
    codes = np.arange(2 ** n, dtype=np.int64)
    return ((codes[None, :] >> np.arange(n)[:, None]) & 1).astype(np.int8)


def _random_01(n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    # Biased densities so that every count of ones is represented.
    p = rng.uniform(0, 1, size=m)
    return (rng.uniform(0, 1, size=(n, m)) < p).astype(np.int8)


@pytest.mark.parametrize("build", [batcher_network, pairwise_network])
@pytest.mark.parametrize("n", list(range(1, 17)))
def test_sorting_networks_sort_every_01_input(build, n):
    cols = _all_01(n)
    assert np.array_equal(_apply(build(n), cols), np.sort(cols, axis=0))


@pytest.mark.parametrize("build", [batcher_network, pairwise_network])
@pytest.mark.parametrize("n", [17, 20, 23, 31, 33, 50, 64, 100])
def test_sorting_networks_sort_random_inputs(build, n):
    rng = np.random.default_rng(n)
    for cols in (_random_01(n, 4000, rng), rng.integers(-3, 4, size=(n, 2000)), rng.normal(size=(n, 2000))):
        assert np.array_equal(_apply(build(n), cols), np.sort(cols, axis=0))


def _selection_cases(n: int):
    lo, hi = (n - 1) // 2, n // 2
    yield frozenset({lo, hi}), frozenset()                       # median
    for f in {1, n // 5, (n - 1) // 2}:
        if 0 < f and 2 * f < n:
            yield frozenset(), frozenset(range(f, n - f))        # trimmed mean's middle
            w = n - f                                            # MeaMed's window ends
            zone = set(range(0, f + 1)) | set(range(w - 1, n))
            yield frozenset(zone | {lo, hi}), frozenset(p for p in range(f, w) if p not in zone)


@pytest.mark.parametrize("n", list(range(1, 15)) + [16])
def test_pruned_networks_give_the_requested_outputs_on_every_01_input(n):
    cols = _all_01(n)
    ref = np.sort(cols, axis=0)
    for exact, group in _selection_cases(n):
        out = _apply(selection_network(n, exact, group), cols)
        for p in exact:
            assert np.array_equal(out[p], ref[p]), (n, sorted(exact), p)
        if group:
            g = sorted(group)
            # Same multiset at the group positions: for 0-1 inputs, the same number of ones.
            assert np.array_equal(out[g].sum(axis=0), ref[g].sum(axis=0)), (n, g)


@pytest.mark.parametrize("n", [17, 20, 21, 33, 50])
def test_pruned_networks_on_random_real_inputs(n):
    rng = np.random.default_rng(100 + n)
    cols = np.concatenate([rng.normal(size=(n, 3000)), rng.integers(-2, 3, size=(n, 3000))], axis=1)
    ref = np.sort(cols, axis=0)
    for exact, group in _selection_cases(n):
        out = _apply(selection_network(n, exact, group), cols)
        for p in exact:
            assert np.array_equal(out[p], ref[p])
        if group:
            g = sorted(group)
            assert np.array_equal(np.sort(out[g], axis=0), ref[g])


def test_pruning_saves_comparators_and_is_never_longer_than_the_sort():
    # n = 20: Batcher sorts with 103 comparators, the pairwise network with 97; the median needs 73
    # of them (positions 9 and 10 only), i.e. pruning removes a quarter of the work.
    assert (len(batcher_network(20)), len(pairwise_network(20))) == (103, 97)
    assert len(selection_network(20, frozenset({9, 10}))) == 73
    for n in range(1, 30):
        assert len(selection_network(n, frozenset(range(n)))) <= max(len(batcher_network(n)), len(pairwise_network(n)))


def test_prune_drops_comparators_inside_a_group_only():
    # Positions 1..2 as a set of 4 values: the last comparator (1, 2) only orders the group.
    net = ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2))
    assert prune(net, frozenset(), frozenset({1, 2})) == ((0, 1), (2, 3), (0, 2), (1, 3))
    assert prune(net, frozenset({1}), frozenset()) == net
    assert prune(net, frozenset({0}), frozenset()) == ((0, 1), (2, 3), (0, 2))


def test_networks_are_cached_and_hashable_inputs_work():
    a = selection_network(12, frozenset({5, 6}))
    assert selection_network(12, frozenset({6, 5})) is a
    assert all(i < j for i, j in itertools.chain(a, batcher_network(12), pairwise_network(12)))
