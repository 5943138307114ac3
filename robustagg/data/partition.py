"""Partitions of a labelled pool among n workers (iid and the heterogeneous schemes of the literature).

Every scheme is deterministic given the numpy ``Generator``; see :func:`partition` for the
definitions and their sources.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError

__all__ = ["PARTITIONS", "SCHEME_PARAMETERS", "partition", "train_test_split"]

#: The partition schemes :func:`partition` knows.
PARTITIONS = ("iid", "dirichlet", "label_sorted", "long_tail")

#: The keyword arguments of :func:`partition` each scheme reads (the others ignore them).
SCHEME_PARAMETERS: dict[str, tuple[str, ...]] = {"iid": (), "dirichlet": ("alpha", "min_samples", "max_tries"),
                                                 "label_sorted": ("shards_per_worker",), "long_tail": ("imbalance",)}


def train_test_split(y: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: from each class, ``round(test_fraction * count)`` random examples go to test.

    Returns:
        ``(train_idx, test_idx)``, each sorted.

    Raises:
        ConfigError: ``test_fraction`` outside ``(0, 1)``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction must be in (0, 1); got {test_fraction}.")
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _iid(n_items: int, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(p) for p in np.array_split(rng.permutation(n_items), parts)]


def partition(y: np.ndarray, parts: int, scheme: str, *, rng: np.random.Generator, alpha: float = 0.5,
              shards_per_worker: int = 2, imbalance: float = 10.0, num_classes: Optional[int] = None,
              min_samples: int = 1, max_tries: int = 100) -> list[np.ndarray]:
    """Split example indices ``0..len(y)-1`` among ``parts`` workers.

    Schemes:
        - ``iid``: a random permutation cut into ``parts`` nearly equal pieces.
        - ``dirichlet``: for each class, shares ``p ~ Dir(alpha * 1)`` over the workers; the class's
          examples (shuffled) are cut at ``cumsum(p)``. Redrawn until every worker holds at least
          ``min_samples`` examples, at most ``max_tries`` times (Hsu, Qi, Brown, 2019).
        - ``label_sorted``: examples sorted by label, cut into ``parts * shards_per_worker`` equal
          shards, each worker gets ``shards_per_worker`` random shards (McMahan et al., AISTATS 2017).
        - ``long_tail``: class ``c`` keeps ``ceil(count_c * imbalance ** (-c / (C - 1)))`` of its
          examples (rare classes at high labels, as in Cao et al., NeurIPS 2019), then ``iid``.

    Args:
        y: int labels ``(N,)``; parts: number of workers; scheme: see above; rng: numpy Generator.

    Returns:
        ``parts`` sorted int64 index arrays (some may be empty: the caller decides).

    Raises:
        ConfigError: bad parameters. (When ``dirichlet`` never reaches ``min_samples`` for every
            worker, the last draw is returned; the caller reports the workers
            left short.)

    Example:
        >>> import numpy as np
        >>> y = np.array([0, 0, 0, 0, 1, 1, 1, 1])
        >>> [p.tolist() for p in partition(y, 2, "label_sorted", rng=np.random.default_rng(0), shards_per_worker=1)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if scheme not in PARTITIONS:
        raise ConfigError(f"unknown partition {scheme!r}; choose one of {', '.join(PARTITIONS)}.")
    n_items = len(y)
    C = int(num_classes if num_classes is not None else (y.max() + 1 if n_items else 1))
    if parts < 1:
        raise ConfigError(f"the number of workers must be >= 1; got {parts}.")
    if scheme == "iid":
        return _iid(n_items, parts, rng)
    if scheme == "dirichlet":
        if not alpha > 0:
            raise ConfigError(f"data.alpha must be > 0 for the dirichlet partition; got {alpha}.")
        by_class = [np.flatnonzero(y == c) for c in range(C)]
        out: list[np.ndarray] = []
        for _ in range(max(1, max_tries)):
            buckets: list[list[np.ndarray]] = [[] for _ in range(parts)]
            for idx in by_class:
                idx = rng.permutation(idx)
                p = rng.dirichlet(alpha * np.ones(parts))
                cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
                for w, piece in enumerate(np.split(idx, cuts)):
                    buckets[w].append(piece)
            out = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
            if min(len(o) for o in out) >= min_samples:
                return out
        return out  # the caller reports the workers left short
    if scheme == "label_sorted":
        if shards_per_worker < 1:
            raise ConfigError(f"data.shards_per_worker must be >= 1; got {shards_per_worker}.")
        perm = rng.permutation(n_items)  # random order within each class
        order = perm[np.argsort(y[perm], kind="stable")]
        shards = np.array_split(order, parts * shards_per_worker)
        assign = rng.permutation(parts * shards_per_worker)
        return [np.sort(np.concatenate([shards[s] for s in assign[w * shards_per_worker:(w + 1) * shards_per_worker]]))
                .astype(np.int64) for w in range(parts)]
    if scheme == "long_tail":
        if not imbalance >= 1:
            raise ConfigError(f"data.imbalance must be >= 1 for the long_tail partition; got {imbalance}.")
        keep = []
        for c in range(C):
            idx = rng.permutation(np.flatnonzero(y == c))
            frac = imbalance ** (-c / (C - 1)) if C > 1 else 1.0
            keep.append(idx[:int(np.ceil(len(idx) * frac))])
        pool = np.sort(np.concatenate(keep))
        return [np.sort(pool[p]) for p in _iid(len(pool), parts, rng)]
    raise ConfigError(f"unknown partition {scheme!r}")  # pragma: no cover - Enum covers it
