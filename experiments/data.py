"""The ``data`` config node -> a :class:`robustagg.data.DataBundle` (wiring only).

The sources, partitions and the bundle live in :mod:`robustagg.data`; this module reads the Hydra
node and reports a partition that leaves a worker without data in config terms.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from robustagg.data import DataBundle, load_digits, make_synthetic, partition, train_test_split
from robustagg.errors import ConfigError

from .config import ByzantineData, DataName, Partition

__all__ = ["build_data"]


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
