"""Sharded optimizer state (``trainer.state_sharding=optimizer``): each rank owns its slice's state.

With ``trainer.reduction=sharded`` rank r already aggregates the coordinates ``[a_r, b_r)`` of
:func:`~robustagg.distributed.sharded.shard_bounds`. Here the same rank also owns the optimizer
state of those coordinates and applies the server step to them alone (the shape of ZeRO stage 1,
Rajbhandari, Rasley, Ruwase, He, "ZeRO: memory optimizations toward training trillion parameter
models", SC 2020); the updated parameter slices are then all-gathered, so every rank holds the
whole model again. Optimizer-state memory per rank falls from ``O(d)`` to ``O(d / world)``.

**Bit-identity with the unsharded run.** The supported optimizers (:data:`ELEMENTWISE`) update
every coordinate from that coordinate's gradient and state alone, with per-group scalars (learning
rate, betas, weight decay, the step count). A slice is cut along parameter tensors into *pieces*
(one per parameter it overlaps), each piece joins its parameter's group, and the per-group
scalars are copied from the full optimizer (whose ``param_groups`` the scheduler drives) before
every step, so each coordinate is computed by the same sequence of floating-point operations as
in the unsharded optimizer: the parameters are bit-identical (tested for SGD with momentum,
Adam and AdamW).

**Checkpoints.** The replicated file keeps the full optimizer's hyperparameters and
``optimizer_sharding`` (``d``, ``world``); each rank's own file keeps its shard
(:meth:`OptimizerShard.export`: its coordinate range and the pieces' state). A restore takes,
for every piece of the *new* slicing, the overlapping parts of whichever shards hold them
(:func:`state_for`): onto the same world size that is the rank's own shard; onto another world
size (a shrink) the shards are re-sliced, and an unsharded checkpoint (the full state) is sliced
the same way. A range no shard holds is refused with the range named.

**What is not cross-checked**: a rank's own slice of the state is held once; a wrong value in it
(a bit flip, a lying rank) changes that slice's parameters, which the digest agreement of
:meth:`~robustagg.training.Trainer.check_parameters` then catches on every rank (the gathered
parameters differ nowhere else), but it cannot say which state was wrong or repair it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ConfigError

__all__ = ["ELEMENTWISE", "OptimizerShard", "state_for", "full_shard", "optimizer_state_bytes", "shard_bytes",
           "shard_from_bytes"]

#: Optimizers whose step is coordinate-wise given per-group scalars, so that a slice's step equals
#: the full step on those coordinates.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad")


def _offsets(params: Sequence[torch.Tensor]) -> list[int]:
    out, at = [], 0
    for p in params:
        out.append(at)
        at += p.numel()
    return out


def _pieces(params: Sequence[torch.Tensor], start: int, end: int) -> list[tuple[int, int, int]]:
    """``(parameter index, lo, hi)`` of the parts of the flat range ``[start, end)`` in each parameter."""
    out = []
    for i, (off, p) in enumerate(zip(_offsets(params), params)):
        lo, hi = max(start, off), min(end, off + p.numel())
        if lo < hi:
            out.append((i, lo - off, hi - off))
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (momentum buffers, moments, step counters)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class OptimizerShard:
    """This rank's part of a sharded optimizer: the state of the coordinates ``[start, end)``.

    Args:
        optimizer: the trainer's full optimizer over ``params``. It keeps the hyperparameters
            (a scheduler steps them) and never holds state itself.
        params: the model's parameters in flattening order (``d`` coordinates in all).
        bounds: every rank's ``(start, end)`` (:func:`~robustagg.distributed.sharded.shard_bounds`).
        rank: this rank; ``group``: the process group the parameter slices are all-gathered in
            (``None``: the default group; a world of one needs none).

    Raises:
        ConfigError: the optimizer is not in :data:`ELEMENTWISE`, or ``bounds`` do not tile ``[0, d)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 bounds: Sequence[tuple[int, int]], rank: int, group: Optional[Any] = None) -> None:
        name = type(optimizer).__name__
        if name not in ELEMENTWISE or not isinstance(optimizer, getattr(torch.optim, name)):
            raise ConfigError(f"trainer.state_sharding=optimizer needs an optimizer that updates each coordinate "
                              f"from its own gradient and state ({', '.join(ELEMENTWISE)}); got {name}.")
        self.params = list(params)
        self.d = sum(p.numel() for p in self.params)
        self.bounds = [(int(a), int(b)) for a, b in bounds]
        if self.bounds[0][0] != 0 or self.bounds[-1][1] != self.d or any(
                self.bounds[i][1] != self.bounds[i + 1][0] for i in range(len(self.bounds) - 1)):
            raise ConfigError(f"OptimizerShard: bounds {self.bounds[:3]}... do not tile [0, {self.d}).")
        self.rank, self.group, self.full = int(rank), group, optimizer
        self.offsets = _offsets(self.params)  # each parameter's first flat coordinate
        self.start, self.end = self.bounds[self.rank]
        self.pieces = _pieces(self.params, self.start, self.end)
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        self._group_of = [group_of[id(self.params[i])] for i, _, _ in self.pieces]
        self.tensors = [self.params[i].detach().reshape(-1)[lo:hi].clone() for i, lo, hi in self.pieces]
        groups = []
        for g, grp in enumerate(optimizer.param_groups):
            mine = [t for t, gi in zip(self.tensors, self._group_of) if gi == g]
            if mine:
                groups.append({**{k: v for k, v in grp.items() if k != "params"}, "params": mine})
        self._groups = sorted(set(self._group_of))  # the full optimizer's groups this shard has pieces in
        self.local: Optional[torch.optim.Optimizer] = type(optimizer)(groups) if groups else None

    def step(self, aggregate: torch.Tensor) -> None:
        """One server step on this slice, then every rank's updated slice all-gathered into the parameters.

        Args:
            aggregate: ``(d,)`` the step's aggregate (every rank holds it after the reduction).

        Raises:
            CollectiveError-like ``RuntimeError``: the all-gather failed (a peer died).
        """
        self.local_step(aggregate)
        self.gather()

    def local_step(self, aggregate: torch.Tensor) -> None:
        """The server step on this slice's state and parameter copies alone (no communication).

        A redundant holder of another rank's slice (``trainer.shard_redundancy``) calls only this:
        the same floating-point operations on the same inputs, so its copy stays bit-equal to the
        owner's state. Shape: ``aggregate`` ``(d,)``.
        """
        flat = aggregate.reshape(-1)
        if self.local is None:
            return
        for grp, g in zip(self.local.param_groups, self._groups):  # the scheduler drives the full one
            grp.update({k: v for k, v in self.full.param_groups[g].items() if k != "params"})
        for t, (i, lo, hi) in zip(self.tensors, self.pieces):
            t.grad = flat[self.offsets[i] + lo:self.offsets[i] + hi].to(t.dtype).clone()
        self.local.step()

    def gather(self) -> None:
        """All-gather every rank's updated slice into the full parameters (world 1: a copy).

        Raises:
            CollectiveError-like ``RuntimeError``: the all-gather failed (a peer died).
        """
        mine = (torch.cat([t.detach() for t in self.tensors]) if self.tensors
                else torch.empty(0, dtype=self.params[0].dtype))
        world = len(self.bounds)
        if world == 1:
            whole = mine
        else:
            width = max(b - a for a, b in self.bounds)
            send = torch.zeros(width, dtype=mine.dtype)
            send[:mine.numel()] = mine
            got = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(got, send, group=self.group)
            whole = torch.cat([got[r][:b - a] for r, (a, b) in enumerate(self.bounds)])
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                p.copy_(whole[off:off + p.numel()].view_as(p))

    def state_bytes_view(self) -> torch.Tensor:
        """This shard's optimizer state as one ``uint8`` vector in :func:`shard_bytes`' layout."""
        return shard_bytes(self.export(copy=False))

    def state_bytes(self) -> int:
        """Bytes of this shard's optimizer state (:func:`optimizer_state_bytes`)."""
        return 0 if self.local is None else optimizer_state_bytes(self.local)

    def unsharded_bytes(self) -> int:
        """What the unsharded optimizer would hold for the same state keys: each per-coordinate
        tensor over all ``d`` coordinates, each scalar once per parameter (0 before the first step)."""
        if self.local is None or not self.local.state:
            return 0
        total = 0
        key, sample = next(iter(self.local.state.items()))
        piece = key.numel()
        for v in sample.values():
            if isinstance(v, torch.Tensor):
                per_coord = v.dim() > 0 and v.numel() == piece
                total += v.element_size() * (self.d if per_coord else v.numel() * len(self.params))
        return total

    def export(self, copy: bool = True) -> dict[str, Any]:
        """This shard for a checkpoint: ``{"d", "start", "end", "pieces": [{"param", "lo", "hi", "state"}]}``
        (``copy=False``: the live tensors, for a reader that does not keep them)."""
        states = [] if self.local is None else [self.local.state.get(t, {}) for t in self.tensors]
        return {"d": self.d, "start": self.start, "end": self.end,
                "pieces": [{"param": i, "lo": lo, "hi": hi,
                            "state": {k: (v.clone() if copy and isinstance(v, torch.Tensor) else v)
                                      for k, v in s.items()}}
                           for (i, lo, hi), s in zip(self.pieces, states or [{}] * len(self.pieces))]}

    def load(self, shards: Sequence[Mapping[str, Any]]) -> None:
        """Take this shard's state from ``shards`` (any slicing of the same parameters, :func:`state_for`).

        Raises:
            CheckpointError: a coordinate of this shard is in none of ``shards``, or their parts disagree.
        """
        if self.local is None:
            return
        for t, (i, lo, hi) in zip(self.tensors, self.pieces):
            st = state_for(shards, i, lo, hi, self.params[i])
            self.local.state[t] = st
            if not st:
                self.local.state.pop(t)
        with torch.no_grad():
            for t, (i, lo, hi) in zip(self.tensors, self.pieces):
                t.copy_(self.params[i].detach().reshape(-1)[lo:hi])


def full_shard(optimizer_state: Mapping[str, Any], optimizer: torch.optim.Optimizer,
               params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """An unsharded optimizer's ``state_dict()`` as one shard covering ``[0, d)`` (for :func:`state_for`).

    Args:
        optimizer_state: the ``state_dict()`` (state keyed by the position of each parameter in
            the groups' order). optimizer: an optimizer with the same groups over ``params``
            (it says which parameter each position is). params: the flattening order.
    """
    pos_of = {id(p): i for i, p in enumerate(params)}
    order = [pos_of[id(p)] for grp in optimizer.param_groups for p in grp["params"]]
    keys = [k for grp in optimizer_state["param_groups"] for k in grp["params"]]
    pieces = []
    for key, pos in zip(keys, order):
        s = optimizer_state["state"].get(key, {})
        n = params[pos].numel()
        pieces.append({"param": pos, "lo": 0, "hi": n,
                       "state": {k: (v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == n
                                     else v) for k, v in s.items()}})
    d = sum(p.numel() for p in params)
    return {"d": d, "start": 0, "end": d, "pieces": pieces}


def state_for(shards: Sequence[Mapping[str, Any]], param: int, lo: int, hi: int, like: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of parameter ``param``'s flat coordinates ``[lo, hi)``, cut from ``shards``.

    Per-coordinate tensors (as long as their piece) are concatenated from the overlapping pieces;
    everything else (a step counter) must be equal in every piece that overlaps.

    Returns:
        ``{key: value}``: per-coordinate tensors of length ``hi - lo``; ``{}`` when no piece has state.

    Raises:
        CheckpointError: part of ``[lo, hi)`` is in no shard, or the overlapping pieces disagree
            on their keys or scalars.
    """
    parts = sorted(((max(lo, int(p["lo"])), min(hi, int(p["hi"])), p) for s in shards for p in s["pieces"]
                    if int(p["param"]) == int(param) and max(lo, int(p["lo"])) < min(hi, int(p["hi"]))),
                   key=lambda x: x[0])
    chosen, at = [], lo
    for a, b, p in parts:  # one cover of [lo, hi), in order (overlapping shards: the first wins)
        if b <= at:
            continue
        if a > at:
            break
        chosen.append((at, b, p))
        at = b
    if at < hi:
        raise CheckpointError(f"no optimizer-state shard holds coordinates [{at}, {hi}) of parameter {param}; the "
                              "checkpoint's shards do not cover the model (a rank's file is missing).")
    keys = {tuple(sorted(p["state"])) for _, _, p in chosen}
    if len(keys) != 1:
        raise CheckpointError(f"the optimizer-state shards of parameter {param} disagree on their keys: {sorted(keys)}.")
    out: dict[str, Any] = {}
    for key in next(iter(keys)):
        vals = []
        for a, b, p in chosen:
            v = p["state"][key]
            width = int(p["hi"]) - int(p["lo"])
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == width:
                vals.append(v.reshape(-1)[a - int(p["lo"]):b - int(p["lo"])])
            else:
                vals.append(v)
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in vals):
            out[key] = torch.cat(vals).clone()
        else:
            first = vals[0]
            if any(not _same(v, first) for v in vals[1:]):
                raise CheckpointError(f"the optimizer-state shards of parameter {param} disagree on {key!r}.")
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _value_bytes(v: Any) -> torch.Tensor:
    if v is None:
        return torch.empty(0, dtype=torch.uint8)
    if not isinstance(v, torch.Tensor):
        raise CheckpointError(f"optimizer state value {v!r} is not a tensor: it has no byte layout for parity.")
    return v.detach().contiguous().reshape(-1).view(torch.uint8)


def shard_bytes(shard: Mapping[str, Any]) -> torch.Tensor:
    """A shard's optimizer state as one ``uint8`` vector: piece by piece, each piece's state keys in
    sorted order, each value's raw bytes (a per-coordinate tensor, a 0-d step counter; ``None``
    adds nothing). The layout :func:`shard_from_bytes` reads back, given a template of the keys.

    Raises:
        CheckpointError: a state value is not a tensor (or ``None``).
    """
    parts = [_value_bytes(p["state"][k]) for p in shard["pieces"] for k in sorted(p["state"])]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def shard_from_bytes(data: torch.Tensor, pieces: Sequence[tuple[int, int, int]], template: Mapping[int, Any],
                     d: int, start: int, end: int) -> dict[str, Any]:
    """The shard whose :func:`shard_bytes` are ``data`` (its first bytes; the rest is padding).

    Args:
        data: ``uint8`` bytes, at least as long as the shard's layout.
        pieces: the shard's ``(param, lo, hi)`` (:func:`_pieces` of its range).
        template: for each parameter index of ``pieces``, ``{key: (dtype, per_coordinate, shape)}``
            taken from any piece of the same parameter group (``None`` dtype: a ``None`` value);
            ``{}``: no state yet.
        d: the model's coordinates in all. start: the shard's first coordinate. end: one past its last.

    Raises:
        CheckpointError: ``data`` is shorter than the layout needs.
    """
    at, out = 0, []
    for i, lo, hi in pieces:
        state: dict[str, Any] = {}
        for key, (dtype, per_coord, shape) in sorted(template[i].items()):
            if dtype is None:
                state[key] = None
                continue
            shape = (hi - lo,) if per_coord else tuple(shape)
            size = torch.empty(0, dtype=dtype).element_size() * (math.prod(shape) if shape else 1)
            if at + size > data.numel():
                raise CheckpointError(f"parity bytes end at {data.numel()}, the shard's layout needs {at + size}.")
            state[key] = data[at:at + size].clone().view(dtype).reshape(shape)
            at += size
        out.append({"param": i, "lo": lo, "hi": hi, "state": state})
    return {"d": d, "start": start, "end": end, "pieces": out}
