"""Communicators: the one collective the gather reduction needs, over a process group or in-process.

A communicator hosts one or more *workers* (ranks of the logical world): a
:class:`ProcessGroupComm` hosts exactly one (its process's rank in a ``torch.distributed`` group);
a :class:`LocalComm` hosts all of them in one process (the simulated mode). Both expose the same
``all_gather`` over a mapping ``{worker rank: tensor}`` of the workers they host, so the training
step is written once and runs unchanged in both modes. Every call increments ``seq``, the
collective sequence number that headers carry so desynchronised ranks are caught.

Control-plane agreement (checkpoint commits, the choice of a checkpoint to restore) uses
:meth:`Communicator.vote`: one integer per process, *not* counted in ``seq``, so writing or
restoring a checkpoint leaves the data-plane sequence exactly where an uninterrupted run has it.
Both kinds of call are recorded (:attr:`Communicator.last`, :attr:`Communicator.last_completed`)
for the failure evidence: group id, sequence number, op, shape, dtype, start time and deadline.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import DesyncError, RobustAggError, ShapeError

__all__ = ["CollectiveError", "CollectiveRecord", "Communicator", "ProcessGroupComm", "LocalComm", "block_hosts"]


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
        group: the communicator's :attr:`~Communicator.group_id`.
        deadline: ``started + timeout`` (``time.time()`` seconds) when the group has a collective
            timeout, else ``None``.
    """

    seq: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    started: float
    finished: Optional[float] = None
    group: str = ""
    deadline: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (``in_flight`` is true while ``finished`` is ``None``)."""
        return {"group": self.group, "seq": self.seq, "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "started": self.started, "finished": self.finished, "deadline": self.deadline,
                "in_flight": self.finished is None}


class Communicator(abc.ABC):
    """Collectives among the ``world_size`` workers of a run, some of which this process hosts.

    Attributes:
        world_size: number of workers ``n``.
        rank: this process's rank (0 for a :class:`LocalComm`); rank 0 is the main process.
        local_ranks: the worker ranks this process hosts, ascending.
        device: where exchanged tensors live.
        seq: number of collectives issued so far (all ranks must agree).
        last: the last :class:`CollectiveRecord` started (still in flight when its ``finished``
            is ``None``), or ``None``.
        last_completed: the last :class:`CollectiveRecord` that finished, or ``None``.
        group_id: a name for the group in evidence (e.g. ``"<run id>/attempt-1"``).
        timeout_s: the group's collective timeout in seconds (``None``: unknown or none).
    """

    world_size: int
    rank: int
    local_ranks: tuple[int, ...]
    device: torch.device

    def __init__(self) -> None:
        self.seq = 0
        self.last: Optional[CollectiveRecord] = None
        self._completed: Optional[CollectiveRecord] = None
        self.group_id = ""
        self.timeout_s: Optional[float] = None

    @property
    def last_completed(self) -> Optional[CollectiveRecord]:
        """The last collective that finished (also when a mode records :attr:`last` itself)."""
        if self.last is not None and self.last.finished is not None:
            return self.last
        return self._completed

    @property
    def num_processes(self) -> int:
        """Number of processes in the group (``world_size`` for a process group, 1 in one process)."""
        return self.world_size

    def begin_record(self, op: str, shape: tuple[int, ...], dtype: str) -> CollectiveRecord:
        """Record the start of a collective (``seq`` as it stands, group id, deadline) as :attr:`last`.

        Modes that issue their own ``torch.distributed`` calls (e.g. ``sharded``) call this and
        :meth:`end_record` around each one, so failure evidence names the collective in flight.
        """
        if self.last is not None and self.last.finished is not None:
            self._completed = self.last
        now = time.time()
        deadline = None if self.timeout_s is None else now + float(self.timeout_s)
        self.last = CollectiveRecord(self.seq, op, shape, dtype, now, None, self.group_id, deadline)
        return self.last

    def end_record(self, rec: CollectiveRecord) -> None:
        """Mark the collective ``rec`` (from :meth:`begin_record`) finished now."""
        done = CollectiveRecord(rec.seq, rec.op, rec.shape, rec.dtype, rec.started, time.time(), rec.group,
                                rec.deadline)
        self.last = self._completed = done

    @property
    def is_main(self) -> bool:
        """True in the process that logs and writes run files (rank 0)."""
        return self.rank == 0

    def all_gather(self, local: Mapping[int, torch.Tensor], *, members: Optional[Sequence[int]] = None,
                   like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stack one tensor per worker, in rank order, on every process.

        Args:
            local: ``{rank: tensor}`` for exactly the workers this process hosts (among ``members``);
                every tensor has the same shape and dtype on every rank.
            members: the worker ranks that contribute to this collective, ascending (default: every
                worker). A protocol with partial participation gathers only the round's
                participants; every process still takes part (one that hosts none of them passes
                ``local={}`` and ``like``).
            like: a tensor of the shape and dtype every contribution has; needed when ``local`` is
                empty (this process hosts no member), ignored otherwise.

        Shape: each tensor ``s``; returns ``(len(members), *s)`` on :attr:`device`.

        Raises:
            ShapeError: ``local`` does not hold exactly the hosted members, shapes differ, members
                are not ascending distinct worker ranks, or ``local`` is empty without ``like``.
            CollectiveError: the collective failed or timed out.
        """
        mem = tuple(range(self.world_size)) if members is None else tuple(int(m) for m in members)
        if members is not None and (list(mem) != sorted(set(mem)) or not mem or mem[0] < 0
                                    or mem[-1] >= self.world_size):
            raise ShapeError(f"members must be ascending distinct worker ranks in [0, {self.world_size}); "
                             f"got {list(mem)}.")
        hosted = [r for r in self.local_ranks if r in set(mem)] if members is not None else list(self.local_ranks)
        if sorted(local) != hosted:
            raise ShapeError(f"all_gather needs one tensor for each hosted worker {hosted}; got {sorted(local)}.")
        if local:
            first = local[hosted[0]]
            if any(t.shape != first.shape or t.dtype != first.dtype for t in local.values()):
                raise ShapeError("all_gather: every hosted worker must pass the same shape and dtype.")
        elif like is None:
            raise ShapeError("all_gather: this process hosts none of the members; pass like= (a tensor of the "
                             "contributions' shape and dtype).")
        else:
            first = like
        self.seq += 1
        rec = self.begin_record("all_gather", tuple(first.shape), str(first.dtype))
        out = self._all_gather(local, mem, first)
        self.end_record(rec)
        return out

    def vote(self, value: int, *, op: str) -> list[int]:
        """Control-plane agreement: every process contributes one integer; all get the list.

        Not counted in :attr:`seq` (checkpoint and restore protocols must not shift the data-plane
        sequence numbers a resumed run compares), but recorded in :attr:`last` as ``vote:<op>``.

        Args:
            value: this process's value (fits an int64).
            op: what the vote is about (for evidence), e.g. ``"checkpoint-files"``.

        Returns:
            one value per process, in process-rank order (length :attr:`num_processes`).

        Raises:
            CollectiveError: the collective failed or timed out.

        Example:
            >>> LocalComm(3).vote(7, op="demo")  # one process hosts every worker
            [7]
        """
        rec = self.begin_record(f"vote:{op}", (1,), "torch.int64")
        out = self._vote(int(value))
        self.end_record(rec)
        return out

    def _vote(self, value: int) -> list[int]:
        return [value]

    @abc.abstractmethod
    def _all_gather(self, local: Mapping[int, torch.Tensor], members: tuple[int, ...],
                    like: torch.Tensor) -> torch.Tensor:
        """The transport-specific gather (validated input; ``like`` has every contribution's shape and dtype)."""

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
    """A communicator over a ``torch.distributed`` process group: this process hosts one or more workers.

    Args:
        group: the process group (``None``: the default group, which must be initialised).
        device: device of the exchanged tensors (CUDA for NCCL, CPU for gloo).
        timeout_s: the group's collective timeout (recorded as each collective's deadline).
        group_id: a name for the group in failure evidence.
        hosts: ``hosts[w]`` is the process rank that hosts worker ``w`` (default: one worker per
            process, worker ``w`` on process ``w``). Every process must host at least one worker.
            See :func:`block_hosts` for the contiguous blocks the launcher uses.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ShapeError: ``hosts`` names a process outside the group or leaves a process without a worker.
    """

    def __init__(self, group: Optional[Any] = None, device: torch.device | str = "cpu", *,
                 timeout_s: Optional[float] = None, group_id: str = "", hosts: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupComm needs an initialised process group "
                               "(robustagg.distributed.launch.init_group or torch.distributed.init_process_group).")
        self.group = group
        self.processes = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.hosts = tuple(range(self.processes)) if hosts is None else tuple(int(h) for h in hosts)
        if sorted(set(self.hosts)) != list(range(self.processes)):
            raise ShapeError(f"hosts must place the workers on every one of the {self.processes} processes "
                             f"(ranks 0..{self.processes - 1}) and on no other; got {list(self.hosts)}.")
        self.world_size = len(self.hosts)
        self.local_ranks = tuple(w for w, h in enumerate(self.hosts) if h == self.rank)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.group_id = group_id

    @property
    def num_processes(self) -> int:
        """Number of processes in the group."""
        return self.processes

    def _all_gather(self, local: Mapping[int, torch.Tensor], members: tuple[int, ...],
                    like: torch.Tensor) -> torch.Tensor:
        # every process contributes the same number of slots (the most members one process hosts),
        # padded; the placement is known everywhere, so each process unpads the same way
        per: list[list[int]] = [[] for _ in range(self.processes)]
        for w in members:
            per[self.hosts[w]].append(w)
        slots = max(len(p) for p in per)
        mine = per[self.rank]
        direct = self.hosts == members  # one worker per process, every one a member: no padding
        if direct:
            t = local[mine[0]].to(self.device).contiguous()
        else:
            t = torch.zeros((slots, *like.shape), dtype=like.dtype, device=self.device)
            for i, w in enumerate(mine):
                t[i].copy_(local[w])
        out = [torch.empty_like(t) for _ in range(self.processes)]
        try:
            dist.all_gather(out, t, group=self.group)
        except Exception as exc:  # backend errors differ by backend and version
            raise CollectiveError(f"all_gather #{self.seq} (shape {tuple(t.shape)}, {t.dtype}) failed on rank "
                                  f"{self.rank}: {exc}") from exc
        if direct:
            return torch.stack(out)
        where = {w: (self.hosts[w], per[self.hosts[w]].index(w)) for w in members}
        return torch.stack([out[where[w][0]][where[w][1]] for w in members])

    def _vote(self, value: int) -> list[int]:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.processes)]
        try:
            dist.all_gather(out, t, group=self.group)
        except Exception as exc:
            raise CollectiveError(f"{self.last.op if self.last else 'vote'} failed on rank {self.rank}: {exc}") from exc
        return [int(o.item()) for o in out]

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

    @property
    def num_processes(self) -> int:
        """1: every worker lives in this process."""
        return 1

    def _all_gather(self, local: Mapping[int, torch.Tensor], members: tuple[int, ...],
                    like: torch.Tensor) -> torch.Tensor:
        return torch.stack([local[r].to(self.device) for r in members])


def block_hosts(n: int, processes: int) -> tuple[int, ...]:
    """Place ``n`` workers on ``processes`` processes in contiguous, balanced blocks.

    Worker ``w`` goes to process ``p`` where the first ``n mod P`` processes host ``ceil(n/P)``
    workers and the rest ``floor(n/P)``.

    Raises:
        ShapeError: ``processes`` is not in ``[1, n]``.

    Example:
        >>> block_hosts(5, 2)
        (0, 0, 0, 1, 1)
    """
    if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= n:
        raise ShapeError(f"processes must be an integer in [1, n={n}] (every process hosts at least one worker); "
                         f"got {processes!r}.")
    base, extra = divmod(n, processes)
    out: list[int] = []
    for p in range(processes):
        out.extend([p] * (base + (1 if p < extra else 0)))
    return tuple(out)
