"""Communicators: the one collective the gather reduction needs, over a process group or in-process.

A communicator hosts one or more *workers* (ranks of the logical world): a
:class:`ProcessGroupComm` hosts exactly one (its process's rank in a ``torch.distributed`` group);
a :class:`LocalComm` hosts all of them in one process (the simulated mode). Both expose the same
``all_gather`` over a mapping ``{worker rank: tensor}`` of the workers they host, so the training
step is written once and runs unchanged in both modes. Every call increments :attr:`seq`, the
collective sequence number that headers carry so desynchronised ranks are caught.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..errors import DesyncError, RobustAggError, ShapeError

__all__ = ["CollectiveError", "CollectiveRecord", "Communicator", "ProcessGroupComm", "LocalComm"]


class CollectiveError(RobustAggError, RuntimeError):
    """A collective failed or timed out: a peer died, hung, or the transport broke.

    A timeout proves that something did not finish in time, not why; the original backend error
    is chained as ``__cause__``.
    """


@dataclass(frozen=True)
class CollectiveRecord:
    """The last collective a communicator started (evidence for failure reports).

    Attributes:
        seq: its sequence number; op: its name; shape and dtype: of the local tensor;
        started: ``time.time()`` at its start; finished: at its end, or ``None`` while in flight.
    """

    seq: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    started: float
    finished: Optional[float] = None


class Communicator(abc.ABC):
    """Collectives among the ``world_size`` workers of a run, some of which this process hosts.

    Attributes:
        world_size: number of workers ``n``.
        rank: this process's rank (0 for a :class:`LocalComm`); rank 0 is the main process.
        local_ranks: the worker ranks this process hosts, ascending.
        device: where exchanged tensors live.
        seq: number of collectives issued so far (all ranks must agree).
        last: the last :class:`CollectiveRecord`, or ``None``.
    """

    world_size: int
    rank: int
    local_ranks: tuple[int, ...]
    device: torch.device

    def __init__(self) -> None:
        self.seq = 0
        self.last: Optional[CollectiveRecord] = None

    @property
    def is_main(self) -> bool:
        """True in the process that logs and writes run files (rank 0)."""
        return self.rank == 0

    def all_gather(self, local: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Stack one tensor per worker, in rank order, on every process.

        Args:
            local: ``{rank: tensor}`` for exactly the workers this process hosts; every tensor has
                the same shape and dtype on every rank.

        Shape: each tensor ``s``; returns ``(world_size, *s)`` on :attr:`device`.

        Raises:
            ShapeError: ``local`` does not hold exactly :attr:`local_ranks`, or shapes differ.
            CollectiveError: the collective failed or timed out.
        """
        if sorted(local) != list(self.local_ranks):
            raise ShapeError(f"all_gather needs one tensor for each hosted worker {list(self.local_ranks)}; "
                             f"got {sorted(local)}.")
        first = local[self.local_ranks[0]]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in local.values()):
            raise ShapeError("all_gather: every hosted worker must pass the same shape and dtype.")
        self.seq += 1
        self.last = CollectiveRecord(self.seq, "all_gather", tuple(first.shape), str(first.dtype), time.time())
        out = self._all_gather(local)
        self.last = CollectiveRecord(self.seq, "all_gather", tuple(first.shape), str(first.dtype),
                                     self.last.started, time.time())
        return out

    @abc.abstractmethod
    def _all_gather(self, local: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The transport-specific gather (validated input)."""

    def agree(self, value: int, *, what: str, step: int) -> None:
        """Check that every hosted worker on every rank holds the same ``value`` (e.g. a digest).

        Args:
            value: this process's value (an int64, e.g. :func:`~robustagg.integrity.checksum`).
            what: what is compared, for the message (``"aggregate digest"``).
            step: the step id, for the message.

        Raises:
            DesyncError: naming the ranks that differ from rank 0.
            CollectiveError: the collective failed or timed out.
        """
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        got = self.all_gather({r: t for r in self.local_ranks}).reshape(-1).tolist()
        bad = [i for i, v in enumerate(got) if v != got[0]]
        if bad:
            raise DesyncError(f"ranks disagree on the {what} at step {step}: rank 0 has {got[0]}, "
                              + ", ".join(f"rank {i} has {got[i]}" for i in bad)
                              + ". Their states diverged; restore every rank from one committed checkpoint.")

    def barrier(self) -> None:
        """Block until every rank arrives (a no-op in one process)."""


class ProcessGroupComm(Communicator):
    """A communicator over a ``torch.distributed`` process group: this process hosts one worker.

    Args:
        group: the process group (``None``: the default group, which must be initialised).
        device: device of the exchanged tensors (CUDA for NCCL, CPU for gloo).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: Optional[Any] = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupComm needs an initialised process group "
                               "(robustagg.distributed.launch.init_group or torch.distributed.init_process_group).")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_ranks = (self.rank,)
        self.device = torch.device(device)

    def _all_gather(self, local: Mapping[int, torch.Tensor]) -> torch.Tensor:
        t = local[self.rank].to(self.device).contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, t, group=self.group)
        except Exception as exc:  # backend errors differ by backend and version
            raise CollectiveError(f"all_gather #{self.seq} (shape {tuple(t.shape)}, {t.dtype}) failed on rank "
                                  f"{self.rank}: {exc}") from exc
        return torch.stack(out)

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except Exception as exc:
            raise CollectiveError(f"barrier failed on rank {self.rank}: {exc}") from exc


class LocalComm(Communicator):
    """All ``world_size`` workers in this process (the simulated mode): collectives are stacks.

    Args:
        world_size: number of workers ``n`` (>= 1).
        device: device of the stacked tensors.

    Example:
        >>> import torch
        >>> c = LocalComm(3)
        >>> c.all_gather({0: torch.tensor([1.0]), 1: torch.tensor([2.0]), 2: torch.tensor([3.0])}).flatten()
        tensor([1., 2., 3.])
        >>> c.seq
        1
    """

    def __init__(self, world_size: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ShapeError(f"world_size must be an integer >= 1; got {world_size!r}.")
        self.world_size = world_size
        self.rank = 0
        self.local_ranks = tuple(range(world_size))
        self.device = torch.device(device)

    def _all_gather(self, local: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return torch.stack([local[r].to(self.device) for r in range(self.world_size)])
