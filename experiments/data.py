"""Data sets and partitions for the trainer: sklearn digits (bundled) and a synthetic Gaussian mixture.

Everything is deterministic from the seed: the train/test split, the partition among workers, the
synthetic samples and the per-worker shifts. Inputs are stored flat (``(N, D)`` float32); image
models reshape them (:attr:`DataBundle.input_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from robustagg.errors import ConfigError
from robustagg.training import Shard

from .config import ByzantineData, DataName, Partition

__all__ = ["DataBundle", "load_digits", "make_synthetic", "train_test_split", "partition", "build_data"]


@dataclass
class DataBundle:
    """A data set split for training by ``n`` workers.

    Attributes:
        train_x ``(N, D)`` float32, train_y ``(N,)`` int64: the training pool.
        test_x, test_y: the held-out set (balanced per class as the source allows).
        num_classes: C. input_shape: per-example shape before flattening (``(1, 8, 8)`` for digits).
        parts: one int64 index array into the training pool per worker (rank order).
        shifts: ``(n, D)`` per-worker input shifts added to that worker's training inputs, or ``None``.
        name: the data set's name. partition: the scheme used.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    parts: list[np.ndarray]
    shifts: Optional[torch.Tensor] = None
    name: str = ""
    partition: str = ""

    def shard(self, rank: int) -> Shard:
        """Worker ``rank``'s training data (a copy)."""
        idx = torch.from_numpy(self.parts[rank])
        x = self.train_x[idx].clone()
        if self.shifts is not None:
            x += self.shifts[rank]
        return Shard(x, self.train_y[idx].clone())

    def root(self, k: int, seed: int) -> Shard:
        """The server's clean root data set: ``k`` training examples drawn uniformly without
        replacement (``numpy`` generator seeded with ``seed``), true labels, no worker shift.

        Raises:
            ConfigError: ``k`` is not in ``[1, N]``.
        """
        n_pool = int(self.train_y.shape[0])
        if not 1 <= k <= n_pool:
            raise ConfigError(f"server.root_samples must be in [1, {n_pool}] (the training pool); got {k}.")
        idx = torch.from_numpy(np.sort(np.random.default_rng([seed, 0x7007]).choice(n_pool, size=k, replace=False)))
        return Shard(self.train_x[idx].clone(), self.train_y[idx].clone())

    def sizes(self) -> list[int]:
        """Number of training examples of every worker."""
        return [len(p) for p in self.parts]

    def label_skew(self) -> list[float]:
        """Per worker, the total-variation distance between its label distribution and the pool's."""
        pool = np.bincount(self.train_y.numpy(), minlength=self.num_classes) / len(self.train_y)
        out = []
        for p in self.parts:
            h = np.bincount(self.train_y.numpy()[p], minlength=self.num_classes) / max(len(p), 1)
            out.append(float(0.5 * np.abs(h - pool).sum()))
        return out


def load_digits() -> tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]:
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels, 10 classes, scaled to [0, 1].

    References: Alpaydin, Kaynak, "Optical Recognition of Handwritten Digits", UCI ML repository, 1998.
    """
    from sklearn.datasets import load_digits as _load

    x, y = _load(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64), 10, (1, 8, 8)


def make_synthetic(*, dim: int, num_classes: int, samples: int, separation: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian mixture: class ``c``'s mean ``mu_c = separation * u_c`` (``u_c`` uniform on the
    unit sphere), examples ``x = mu_c + N(0, I_dim)``, labels balanced (``samples // C`` each, rest
    to the first classes).

    Raises:
        ConfigError: dim, num_classes or samples below 1, or fewer samples than classes.
    """
    if dim < 1 or num_classes < 2 or samples < num_classes:
        raise ConfigError(f"synthetic data needs data.dim >= 1, data.num_classes >= 2 and data.samples >= "
                          f"num_classes; got dim={dim}, num_classes={num_classes}, samples={samples}.")
    u = rng.standard_normal((num_classes, dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    y = np.arange(samples) % num_classes
    x = separation * u[y] + rng.standard_normal((samples, dim))
    return x.astype(np.float32), y.astype(np.int64)


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


def partition(y: np.ndarray, parts: int, scheme: Partition | str, *, rng: np.random.Generator, alpha: float = 0.5,
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
            worker, the last draw is returned; :func:`build_data` reports the workers left short.)

    Example:
        >>> import numpy as np
        >>> y = np.array([0, 0, 0, 0, 1, 1, 1, 1])
        >>> [p.tolist() for p in partition(y, 2, "label_sorted", rng=np.random.default_rng(0), shards_per_worker=1)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    scheme = Partition(scheme)
    n_items = len(y)
    C = int(num_classes if num_classes is not None else (y.max() + 1 if n_items else 1))
    if parts < 1:
        raise ConfigError(f"the number of workers must be >= 1; got {parts}.")
    if scheme is Partition.iid:
        return _iid(n_items, parts, rng)
    if scheme is Partition.dirichlet:
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
    if scheme is Partition.label_sorted:
        if shards_per_worker < 1:
            raise ConfigError(f"data.shards_per_worker must be >= 1; got {shards_per_worker}.")
        perm = rng.permutation(n_items)  # random order within each class
        order = perm[np.argsort(y[perm], kind="stable")]
        shards = np.array_split(order, parts * shards_per_worker)
        assign = rng.permutation(parts * shards_per_worker)
        return [np.sort(np.concatenate([shards[s] for s in assign[w * shards_per_worker:(w + 1) * shards_per_worker]]))
                .astype(np.int64) for w in range(parts)]
    if scheme is Partition.long_tail:
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


def build_data(cfg: object, *, n: int, byzantine_ranks: Sequence[int], seed: int) -> DataBundle:
    """Load the configured data set and partition it among ``n`` workers.

    Args:
        cfg: the ``data`` node (:class:`~experiments.config.DataConf` fields).
        n: number of workers. byzantine_ranks: the Byzantine workers (for ``byzantine_data``).
        seed: the run's seed.

    Raises:
        ConfigError: unknown data set, bad parameters, or a partition that leaves a worker with
            fewer than one example (the message names the workers and how to fix it).
    """
    c = cfg
    rng = np.random.default_rng([int(seed), 0xDA7A])
    name = DataName(getattr(c, "name"))
    if name is DataName.digits:
        x, y, C, shape = load_digits()
    else:
        x, y = make_synthetic(dim=int(getattr(c, "dim")), num_classes=int(getattr(c, "num_classes")),
                              samples=int(getattr(c, "samples")), separation=float(getattr(c, "separation")),
                              rng=rng)
        C, shape = int(getattr(c, "num_classes")), (int(getattr(c, "dim")),)
    tr, te = train_test_split(y, float(getattr(c, "test_fraction")), rng)
    limit = getattr(c, "max_train_samples")
    if limit is not None:
        tr = np.sort(rng.permutation(tr)[:int(limit)])
    ytr = y[tr]
    byz = sorted(set(int(r) for r in byzantine_ranks))
    full = ByzantineData(getattr(c, "byzantine_data")) is ByzantineData.full and byz
    holders = [r for r in range(n) if r not in byz] if full else list(range(n))
    scheme = Partition(getattr(c, "partition"))
    pieces = partition(ytr, len(holders), scheme, rng=rng, alpha=float(getattr(c, "alpha")),
                       shards_per_worker=int(getattr(c, "shards_per_worker")),
                       imbalance=float(getattr(c, "imbalance")), num_classes=C,
                       min_samples=int(getattr(c, "min_samples")), max_tries=int(getattr(c, "max_tries")))
    parts: list[np.ndarray] = [np.arange(len(ytr), dtype=np.int64) for _ in range(n)]
    for r, p in zip(holders, pieces):
        parts[r] = p.astype(np.int64)
    need = max(1, int(getattr(c, "min_samples"))) if scheme is Partition.dirichlet else 1
    empty = [r for r, p in enumerate(parts) if len(p) < need]
    if empty:
        hint = {Partition.dirichlet: "raise data.alpha or data.max_tries", Partition.label_sorted:
                "lower data.shards_per_worker", Partition.long_tail: "lower data.imbalance"}.get(scheme, "")
        hint = (hint + ", " if hint else "") + "lower threat.n, or use more data (data.max_train_samples)"
        raise ConfigError(f"data.partition={scheme.value} leaves worker(s) {empty} of n={n} with no training data "
                          f"(fewer than {need} example(s); {len(ytr)} in the pool); {hint}.")
    shifts = None
    het = float(getattr(c, "heterogeneity", 0.0))
    if name is DataName.synthetic and het > 0:
        u = rng.standard_normal((n, x.shape[1]))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        shifts = torch.from_numpy((het * u).astype(np.float32))
    return DataBundle(train_x=torch.from_numpy(x[tr]), train_y=torch.from_numpy(ytr), test_x=torch.from_numpy(x[te]),
                      test_y=torch.from_numpy(y[te]), num_classes=C, input_shape=tuple(shape), parts=parts,
                      shifts=shifts, name=name.value, partition=scheme.value)
