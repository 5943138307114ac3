"""Deterministic mini-batches from one worker's shard, with a tiny explicit position.

The order of epoch ``e`` of worker ``r`` is ``torch.randperm(size)`` under a generator seeded
from ``(seed, r, e)`` alone, so the sampler's whole state is two integers (epoch, position): a
restored run draws exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ConfigError

__all__ = ["ShardSampler", "mix_seed"]

_MASK = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """Combine integers into one non-negative 63-bit seed (SplitMix64 finaliser over each part).

    Example:
        >>> mix_seed(0, 1, 2) == mix_seed(0, 1, 2), mix_seed(0, 1, 2) == mix_seed(0, 2, 1)
        (True, False)
    """
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK


class ShardSampler:
    """Batches of indices into a shard of ``size`` examples, reshuffled every epoch.

    Definition: epoch ``e`` visits ``randperm(size)`` (generator seeded ``mix_seed(seed, rank, e)``)
    in consecutive chunks of ``b = min(batch_size, size)``; an incomplete last chunk is skipped
    and the next epoch starts, so every batch has exactly ``b`` indices.

    Args:
        size: number of examples in the shard (>= 1).
        batch_size: requested batch size (>= 1).
        seed: the run's seed.
        rank: the worker's rank (different workers get different orders).

    Raises:
        ConfigError: ``size`` or ``batch_size`` below 1.

    Example:
        >>> s = ShardSampler(5, 2, seed=0, rank=0)
        >>> a, b, c = s.next(), s.next(), s.next()  # the third batch starts epoch 1
        >>> sorted(a.tolist() + b.tolist()) == sorted(set(a.tolist() + b.tolist())), s.state_dict()
        (True, {'epoch': 1, 'position': 2})
    """

    def __init__(self, size: int, batch_size: int, *, seed: int, rank: int) -> None:
        if size < 1:
            raise ConfigError(f"worker {rank} has an empty shard; every worker needs at least one example.")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1; got {batch_size}.")
        self.size = int(size)
        self.batch = min(int(batch_size), self.size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.epoch = 0
        self.position = 0
        self._perm: Optional[torch.Tensor] = None
        self._perm_epoch = -1

    def _order(self) -> torch.Tensor:
        if self._perm is None or self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, self.rank, self.epoch))
            self._perm = torch.randperm(self.size, generator=g)
            self._perm_epoch = self.epoch
        return self._perm

    def next(self) -> torch.Tensor:
        """The next batch: a ``(b,)`` int64 tensor of indices into the shard."""
        if self.position + self.batch > self.size:
            self.epoch += 1
            self.position = 0
        idx = self._order()[self.position:self.position + self.batch]
        self.position += self.batch
        return idx

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": e, "position": p}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
