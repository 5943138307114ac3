"""Who keeps a second copy of each slice of the sharded optimizer state, and how (issue 31).

The layout and the keeping; what a rebuild does with them is :mod:`~robustagg.training.shard_recovery`.

- ``trainer.shard_redundancy=k``: slice s is also held by ranks ``s+1, ..., s+k-1`` (mod world),
  which apply the same server step to it
  (:meth:`~robustagg.training.state_sharding.OptimizerShard.local_step`): bit-equal to the
  owner's state, no communication.
- ``trainer.shard_parity=g``: slices grouped ``g`` at a time; after every step one all-reduce
  XORs every slice's state bytes (:func:`~robustagg.training.state_sharding.shard_bytes`) per
  group; the first rank of the next group (cyclically) keeps group j's parity.

Either one makes every rank snapshot its whole state at every step's start (the last two kept),
the boundary survivors can rebuild a lost shard at.

Sources: the single XOR parity over a group is the code of RAID level 5 (Patterson, Gibson, Katz,
"A case for redundant arrays of inexpensive disks (RAID)", SIGMOD 1988), which rebuilds one lost
member of a group from the others and the parity; the sharded state it protects is ZeRO stage 1's
(Rajbhandari et al., SC 2020).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .state_sharding import OptimizerShard

__all__ = ["copy_holders", "held_slices", "parity_groups", "parity_holder", "check_protection", "ShardProtection"]


def copy_holders(slice_: int, world: int, k: int) -> list[int]:
    """The ranks that hold slice ``slice_``'s optimizer state with ``shard_redundancy=k``: its owner first."""
    return [(slice_ + i) % world for i in range(min(k, world))]


def held_slices(rank: int, world: int, k: int) -> list[int]:
    """The other ranks' slices whose copy rank ``rank`` keeps (``k - 1`` of them)."""
    return [(rank - i) % world for i in range(1, min(k, world))]


def parity_groups(world: int, g: int) -> list[list[int]]:
    """The slices of each parity group: ``[0, g), [g, 2g), ...`` (the last may be shorter)."""
    return [list(range(a, min(a + g, world))) for a in range(0, world, g)]


def parity_holder(group: int, world: int, g: int) -> int:
    """The rank that keeps group ``group``'s parity: the first rank of the next group, cyclically."""
    return (group + 1) * g if (group + 1) * g < world else 0


def check_protection(world: int, k: int, g: int, *, key: Mapping[str, str] | None = None) -> None:
    """Refuse a redundancy or parity setting the world size cannot carry.

    Args:
        world: ranks (= slices). k: ``shard_redundancy`` (1: none). g: ``shard_parity`` (0: none).
        key: the setting names for the message (``{"k": "trainer.shard_redundancy", "g": ...}``).

    Raises:
        ConfigError: ``k < 1`` or ``k > world``; ``g == 1`` or fewer than two groups of ``g``; both on.
    """
    kk, gg = (key or {}).get("k", "shard_redundancy"), (key or {}).get("g", "shard_parity")
    if k < 1 or k > world:
        raise ConfigError(f"{kk}={k}: each slice's state is held by k of the {world} ranks; use 1 <= k <= {world}.")
    if g < 0 or g == 1 or (g > 0 and math.ceil(world / g) < 2):
        fix = f"use 2 <= g <= {world - 1}, or 0 (off)" if world >= 3 else "use 0 (off): a parity needs 3 or more ranks"
        raise ConfigError(f"{gg}={g}: a parity group of g >= 2 slices needs at least two groups (its parity lives "
                          f"on a rank outside it); with {world} ranks {fix}.")
    if k > 1 and g > 0:
        raise ConfigError(f"{kk}={k} and {gg}={g} are two sources for the same lost shard; choose one.")


class ShardProtection:
    """The copies (``k``) or parity (``g``) a rank keeps of the sharded optimizer state, and its snapshots.

    Args:
        shard: this rank's :class:`~robustagg.training.state_sharding.OptimizerShard`.
        k: ``shard_redundancy`` (1: no copies). g: ``shard_parity`` (0: no parity).

    Raises:
        ConfigError: :func:`check_protection`.
    """

    def __init__(self, shard: OptimizerShard, k: int = 1, g: int = 0) -> None:
        world = len(shard.bounds)
        check_protection(world, int(k), int(g))
        self.shard, self.k, self.g, self.world = shard, int(k), int(g), world
        self.copies = {s: OptimizerShard(shard.full, shard.params, shard.bounds, s, group=None)
                       for s in held_slices(shard.rank, world, self.k)}
        self.groups = parity_groups(world, self.g) if self.g else []
        self.parity: dict[int, torch.Tensor] = {}
        self.snapshots: list[dict[str, Any]] = []  # the last two, oldest first

    def after_local_step(self, aggregate: torch.Tensor) -> None:
        """Step every held copy with the same aggregate; refresh the parity (one all-reduce per step).

        Raises:
            CollectiveError-like ``RuntimeError``: the parity all-reduce failed (a peer died).
        """
        for c in self.copies.values():
            c.local_step(aggregate)
        if not self.g:
            return
        mine = self.shard.state_bytes_view()
        j = self.shard.rank // self.g
        lengths = torch.zeros(len(self.groups), dtype=torch.int64)
        lengths[j] = mine.numel()
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=self.shard.group)
        width = int(lengths.max())
        buf = torch.zeros(len(self.groups), width, dtype=torch.uint8)
        buf[j, :mine.numel()] = mine
        dist.all_reduce(buf, op=dist.ReduceOp.BXOR, group=self.shard.group)
        self.parity = {i: buf[i].clone() for i in range(len(self.groups))
                       if parity_holder(i, self.world, self.g) == self.shard.rank}

    def load(self, shards: Sequence[Mapping[str, Any]]) -> None:
        """Give every held copy its state from ``shards`` (a restore), and forget the snapshots."""
        for c in self.copies.values():
            c.load(shards)
        self.parity = {}
        self.snapshots = []

    def snapshot(self, state: Mapping[str, Any]) -> None:
        """Keep ``state`` (the trainer's :meth:`~robustagg.training.Trainer.state_dict` at a step's start)
        with the copies and parity of that step, deep-copied; the two newest are kept."""
        snap = {"step": int(state["replicated"]["step"]), "state": copy.deepcopy(state),
                "copies": {s: c.export() for s, c in self.copies.items()},
                "parity": {j: p.clone() for j, p in self.parity.items()}}
        self.snapshots = [*self.snapshots[-1:], snap]

    def payload(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """What this rank writes when the group fails: its rank, the slicing, the settings, the
        checkpoint meta, each parameter's size and optimizer group, and its snapshots."""
        sh = self.shard
        return {"rank": sh.rank, "world": self.world, "bounds": [list(b) for b in sh.bounds],
                "k": self.k, "g": self.g, "meta": dict(meta), "param_sizes": [p.numel() for p in sh.params],
                "param_groups": _param_groups(sh), "snapshots": list(self.snapshots)}


def _param_groups(shard: OptimizerShard) -> list[int]:
    group_of = {id(p): g for g, grp in enumerate(shard.full.param_groups) for p in grp["params"]}
    return [group_of[id(p)] for p in shard.params]
