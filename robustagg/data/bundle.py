"""A data set split among n workers: the training pool, the held-out set, and one index array per worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..training.trainer import Shard

__all__ = ["DataBundle"]


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
        """Worker ``rank``'s training data (a copy: indexing by an index tensor gathers new storage)."""
        idx = torch.from_numpy(self.parts[rank])
        x = self.train_x[idx]
        if self.shifts is not None:
            x += self.shifts[rank]
        return Shard(x, self.train_y[idx])

    def root(self, k: int, seed: int) -> Shard:
        """The server's clean root data set: ``k`` training examples drawn uniformly without
        replacement (``numpy`` generator seeded with ``seed``), true labels, no worker shift
        (FLTrust, Cao et al., NDSS 2021). The examples may also be in a worker's shard: the root set
        is clean, not disjoint.

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
