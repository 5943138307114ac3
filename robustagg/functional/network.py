"""Comparator networks for exact order statistics of a few rows, computed column-wise.

A comparator ``(i, j)`` with ``i < j`` replaces the values at positions ``i`` and ``j`` by their
minimum and maximum (the minimum goes to ``i``). A *sorting network* is a fixed list of
comparators that sorts any input; its comparisons do not depend on the data, so a whole column
chunk ``(n, k)`` goes through it with ``2 * len(network)`` elementwise ``minimum``/``maximum``
calls, exactly (only copies of input values are moved, nothing is rounded).

Two classic constructions are generated here for any ``n`` (padded to a power of two; a
comparator that touches a padding position is dropped, which is exact because a padding value
``+inf`` never leaves the padding positions): Batcher's odd-even merge sort (Batcher, "Sorting
networks and their applications", AFIPS 1968) and the pairwise sorting network (Parberry, "The
pairwise sorting network", Parallel Processing Letters 1992). :func:`selection_network` keeps
only the comparators that can influence the outputs a kernel needs, and returns the shorter of
the two pruned networks.

Correctness is checked in ``tests/test_kernels_network.py`` with the 0-1 principle (a comparator
network is correct on every input iff it is correct on every 0-1 input; Knuth, TAOCP vol. 3,
5.3.4), exhaustively for ``n <= 16``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["Network", "batcher_network", "pairwise_network", "prune", "selection_network"]

#: A comparator network: ``((i, j), ...)`` with ``i < j``; minimum to ``i``, maximum to ``j``.
Network = tuple[tuple[int, int], ...]


def _pow2(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def _restrict(pairs: list[tuple[int, int]], n: int) -> Network:
    # Positions >= n hold +inf padding; a comparator (i, j) with j >= n leaves it there: drop it.
    return tuple((i, j) for i, j in pairs if j < n)


@lru_cache(maxsize=None)
def batcher_network(n: int) -> Network:
    """Batcher's odd-even merge sorting network on ``n`` positions."""
    size = _pow2(n)
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return _restrict(pairs, n)


@lru_cache(maxsize=None)
def pairwise_network(n: int) -> Network:
    """Parberry's pairwise sorting network on ``n`` positions."""
    size = _pow2(n)
    pairs = []
    # Phase 1: sort pairs, then pairs of pairs, ... (comparators at distance a within blocks of 2a).
    a = 1
    while a < size:
        b, c = a, 0
        while b < size:
            pairs.append((b - a, b))
            b, c = b + 1, (c + 1) % a
            if c == 0:
                b += a
        a *= 2
    # Phase 2: merge the sorted halves back with decreasing strides.
    a, e = size // 4, 1
    while a > 0:
        d = e
        while d > 0:
            b, c = (d + 1) * a, 0
            while b < size:
                pairs.append((b - d * a, b))
                b, c = b + 1, (c + 1) % a
                if c == 0:
                    b += a
            d //= 2
        a, e = a // 2, 2 * e + 1
    return _restrict(pairs, n)


def prune(network: Network, exact: frozenset[int], group: frozenset[int] = frozenset()) -> Network:
    """Drop the comparators that cannot change the required outputs.

    After the pruned network, every position in ``exact`` holds the same value as after the full
    sorting network, and the positions in ``group`` hold the same *multiset* of values (in some
    order). Walking backwards, a comparator is kept when it writes a position whose value is
    needed exactly, or when it moves a value between ``group`` and the outside (then both of its
    inputs become needed exactly); a comparator inside ``group`` only permutes the group and is
    dropped, as is one that touches only unneeded positions.
    """
    need_exact = set(exact)
    in_group = set(group) - need_exact
    kept = []
    for i, j in reversed(network):
        if i in need_exact or j in need_exact or ((i in in_group) != (j in in_group)):
            kept.append((i, j))
            need_exact.update((i, j))
            in_group.difference_update((i, j))
    return tuple(reversed(kept))


@lru_cache(maxsize=None)
def selection_network(n: int, exact: frozenset[int], group: frozenset[int] = frozenset()) -> Network:
    """The shortest pruned network (Batcher or pairwise) giving ``exact`` and ``group`` (see :func:`prune`).

    Args:
        n: number of rows (positions), ``n >= 1``.
        exact: 0-based order statistics needed exactly, each in ``[0, n)``.
        group: positions whose multiset of values is needed (e.g. the middle of a trimmed mean).

    Returns:
        The comparators, in execution order.

    Example:
        >>> net = selection_network(3, frozenset({1}))  # the median of three values
        >>> vals = [5.0, 1.0, 3.0]
        >>> for i, j in net:
        ...     vals[i], vals[j] = min(vals[i], vals[j]), max(vals[i], vals[j])
        >>> vals[1]
        3.0
    """
    candidates = [prune(batcher_network(n), exact, group), prune(pairwise_network(n), exact, group)]
    return min(candidates, key=len)
