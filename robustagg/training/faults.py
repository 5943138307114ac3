"""Fault injection: make real processes crash, hang, desynchronise, corrupt, or damage checkpoints.

A :class:`Fault` names a kind, the worker it hits (``rank``) and the step at which it fires
(``step``: the 1-based number of the training step; for checkpoint faults the step of the
checkpoint). A :class:`FaultInjector` is handed to the :class:`~robustagg.training.Trainer` and to
the :class:`~robustagg.training.resume.Checkpointer`; they call its hooks at fixed points of a step,
so a fault is deterministic in ``(rank, step)``. Each fault fires **once per run**: before firing,
the injector appends a record to a log file (``faults.jsonl`` next to the checkpoints, fsynced), and
an injector built after a restart skips every fault already in the log, so replaying the steps
after a restore does not fire it again.

| kind | what happens on worker ``rank`` at step ``step`` |
|---|---|
| ``crash`` | the process dies hard (``how``: ``sigkill``, or ``exit`` = ``os._exit``); ``where``: ``before_step`` (start of the step), ``after_reduce`` (the aggregate is known; this rank dies *before* its optimizer step while the others take theirs), ``after_step``, or ``after_commit`` (right after the checkpoint of step ``step`` is committed, before anything else) |
| ``hang`` | the worker sleeps ``seconds`` inside its compute time (a straggler; past the collective timeout it becomes a fail-stop) |
| ``desync`` | ``mode=skip``: its collective counter jumps one ahead, as after skipping a collective; ``mode=reorder``: it announces the next step's exchange first. The header exchange catches both before any data moves |
| ``corrupt`` | ``bits`` bits of its submission's wire frame are flipped *after* the checksum was taken (corruption in transit) |
| ``nan`` | its submission becomes non-finite (one coordinate set to NaN) |
| ``compute_corrupt`` | a silent error in its gradient arithmetic: one coordinate (chosen from ``(rank, step)``) gets ``+1.0`` *before* the checksum is taken, so every integrity check passes; only a replica vote (``protocol=redundant``) can catch it |
| ``common_mode`` | the same deterministic corruption (one coordinate chosen from ``(rank, step)``, ``+1.0``) on worker ``rank`` *and every replica of its group* (:attr:`FaultInjector.peers`; a shared bug or bad input): the replicas still agree, so the vote does not catch it |
| ``aggregator_lie`` | a lying aggregator: the aggregate (gather) or every slice it computes (sharded) that this rank hands on is wrong (``how``: ``scale`` = times 2, ``sign_flip``, ``stale`` = the previous step's aggregate, zeros at the first step, ``last_bits`` = the lowest bit of one coordinate flipped); caught by ``trainer.on_aggregate_mismatch`` (:mod:`~robustagg.distributed.vote`), not by any integrity check |
| ``checkpoint_crash`` | it dies while writing the checkpoint of step ``step`` (``phase``: ``files`` = mid-way through its own files; ``commit`` = rank 0 after writing the manifest, before the rename that commits it) |
| ``checkpoint_corrupt`` | after the checkpoint of step ``step`` is committed, one byte of one of its files is flipped on disk (``file``; default this rank's own ``rank-<r>.pt``) |
| ``rejoin`` | the process dies (SIGKILL) at the start of the step, like ``crash``; with ``trainer.on_failure=shrink`` and ``trainer.rejoin=true`` the launcher starts its replacement ``seconds`` after the survivors restart, and it joins the running group from a live peer (:mod:`robustagg.launch.grow`) |
| ``partition`` | at the start of step ``step`` the ``workers`` are cut off from the others for good: every process's collective across the cut is blocked (it raises :class:`PartitionedError` at once, as a timeout would after ``collective_timeout_s``); each side then runs the membership quorum (:mod:`robustagg.launch.quorum`). The cut heals after ``seconds``: with ``trainer.rejoin=true`` the cut-off workers then rejoin the majority (as after ``rejoin``); without it they stay out for good. ``rank`` is unused |

A real transport-level skip of a differently sized collective is not injected: gloo pairs the
mismatched buffers and aborts the process, which the trainer can only see as a fail-stop. The
``desync`` fault exercises the detection path the header exists for.

Example (bits flipped after the checksum; the reduction's integrity check then refuses the row):
    >>> import torch
    >>> inj = FaultInjector([Fault("corrupt", rank=1, step=3)], worker_ids={0: 0, 1: 1})
    >>> frame = torch.zeros(16, dtype=torch.uint8)
    >>> bool(inj.tamper(2, 1, frame).any()), bool(inj.tamper(2, 1, frame).any())  # fires once
    (True, False)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from ..checkpoint import append_jsonl, read_jsonl
from ..distributed.comm import CollectiveError
from ..errors import ConfigError
from .sampler import mix_seed



class _HasComm(Protocol):
    """What :meth:`FaultInjector.before_announce` needs of a trainer: its communicator."""

    comm: Any

__all__ = ["KINDS", "LIES", "MEMBERSHIP_KINDS", "Fault", "FaultInjector", "PartitionedError", "Partition", "fired_faults"]

#: Every fault kind, in the order of the table above.
KINDS: tuple[str, ...] = ("crash", "hang", "desync", "corrupt", "nan", "compute_corrupt", "common_mode",
                          "aggregator_lie", "checkpoint_crash", "checkpoint_corrupt")
# --- membership faults (issue 17): their own block, checks and hook ------------------------------
#: Fault kinds that change who can reach whom (checked by :func:`_membership_problems`).
MEMBERSHIP_KINDS = ("partition", "rejoin")
KINDS = KINDS + MEMBERSHIP_KINDS
_WHERE = ("before_step", "after_reduce", "after_step", "after_commit")
_HOW = ("sigkill", "exit")
#: ``aggregator_lie``'s ways to lie (its ``how``).
LIES = ("scale", "sign_flip", "stale", "last_bits")
_EXIT_CODE = 71
_HINT = " (did you mean {}?)"


def _near(word: str, options: Sequence[str], template: str) -> str:
    """``template`` filled with the options nearest to a misspelt ``word`` (difflib), or ``""`` if none is near."""
    import difflib

    near = difflib.get_close_matches(word, list(options), n=2, cutoff=0.6)
    return template.format(" or ".join(near)) if near else ""


@dataclass(frozen=True)
class Fault:
    """One fault to inject.

    Args:
        kind: one of :data:`KINDS`.
        rank: the worker it hits (its rank in the original group; unchanged by an elastic shrink).
        step: the 1-based number of the training step (checkpoint kinds: the checkpoint's step).
        where: ``crash`` only: ``before_step``, ``after_reduce``, ``after_step`` or ``after_commit``
            (right after the commit of the checkpoint of step ``step``; needs a checkpoint there).
        how: ``crash`` and ``checkpoint_crash``: ``sigkill`` or ``exit``; ``aggregator_lie``: one of
            :data:`LIES` (default ``scale``).
        seconds: ``hang`` only: how long the worker stalls (> 0).
        mode: ``desync`` only: ``skip`` or ``reorder``.
        bits: ``corrupt`` only: bits flipped in the frame (>= 1).
        phase: ``checkpoint_crash`` only: ``files`` or ``commit`` (``commit`` needs ``rank=0``).
        file: ``checkpoint_corrupt`` only: the file to damage (``""``: the rank's own file).
        name: an id for logs (default ``"<kind>@<rank>:<step>"``); unique within a run.
        workers: ``partition`` only: the worker ids cut off from the others (non-empty; the
            launcher checks that they leave someone on the other side).
        join_step: ``rejoin`` and ``partition``: the survivors admit the replacement (the cut-off
            workers, once the cut heals) exactly after this many completed steps, waiting for it
            there (0: at the first boundary after it asked); ``>= step`` (a boundary after the loss).

    Raises:
        ConfigError: an unknown kind or option (the nearest valid ones are named), or an
            out-of-range value.

    Example:
        >>> Fault("crash", rank=2, step=5, where="after_reduce").id
        'crash@2:5'
        >>> Fault("melt", rank=0, step=1)
        Traceback (most recent call last):
        ...
        robustagg.errors.ConfigError: unknown fault kind 'melt'; choose one of crash, hang, desync, corrupt, nan, compute_corrupt, common_mode, aggregator_lie, checkpoint_crash, checkpoint_corrupt, partition, rejoin.
        >>> Fault("crashh", rank=0, step=1)
        Traceback (most recent call last):
        ...
        robustagg.errors.ConfigError: unknown fault kind 'crashh' (did you mean crash?); choose one of crash, hang, desync, corrupt, nan, compute_corrupt, common_mode, aggregator_lie, checkpoint_crash, checkpoint_corrupt, partition, rejoin.
        >>> Fault("partition", step=3, workers=[5, 4]).describe()
        {'id': 'partition@0:3', 'kind': 'partition', 'rank': 0, 'step': 3, 'workers': [4, 5], 'seconds': 1.0, 'join_step': 0}
    """

    kind: str
    rank: int = 0
    step: int = 1
    where: str = "before_step"
    how: str = "sigkill"
    seconds: float = 1.0
    mode: str = "skip"
    bits: int = 1
    phase: str = "files"
    file: str = ""
    name: str = ""
    workers: tuple[int, ...] = ()
    join_step: int = 0

    def __post_init__(self) -> None:
        lie = self.kind == "aggregator_lie"
        if lie and self.how == "sigkill":
            object.__setattr__(self, "how", "scale")  # the dataclass default is a crash's
        checks = [
            (self.kind in KINDS, f"unknown fault kind {self.kind!r}{_near(str(self.kind), KINDS, _HINT)}; "
                                 f"choose one of {', '.join(KINDS)}."),
            (int(self.rank) >= 0, f"fault {self.id}: rank must be >= 0; got {self.rank}."),
            (int(self.step) >= 1, f"fault {self.id}: step must be >= 1 (the 1-based step number); got {self.step}."),
            (self.where in _WHERE, f"fault {self.id}: where must be one of {', '.join(_WHERE)}; got {self.where!r}"
                                   f"{_near(str(self.where), _WHERE, _HINT)}."),
            (lie or self.how in _HOW, f"fault {self.id}: how must be sigkill or exit; got {self.how!r}."),
            (not lie or self.how in LIES, f"fault {self.id}: how must be one of {', '.join(LIES)}; got {self.how!r}"
                                          f"{_near(str(self.how), LIES, _HINT)}."),
            (0 < float(self.seconds) < float("inf"), f"fault {self.id}: seconds must be > 0 and finite; got "
                                                     f"{self.seconds}."),
            (self.mode in ("skip", "reorder"), f"fault {self.id}: mode must be skip or reorder; got {self.mode!r}."),
            (int(self.bits) >= 1, f"fault {self.id}: bits must be >= 1; got {self.bits}."),
            (self.phase in ("files", "commit"), f"fault {self.id}: phase must be files or commit; got {self.phase!r}."),
            (not (self.kind == "checkpoint_crash" and self.phase == "commit" and int(self.rank) != 0),
             f"fault {self.id}: phase=commit happens on rank 0 (it alone commits); set rank=0."),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        for msg in _membership_problems(self):
            raise ConfigError(msg)

    @property
    def id(self) -> str:
        """The fault's name, or ``"<kind>@<rank>:<step>"``."""
        return self.name or f"{self.kind}@{self.rank}:{self.step}"

    def describe(self) -> dict[str, Any]:
        """The options that matter for this kind, as a JSON-ready dict (with ``id``)."""
        extra = {"crash": ("where", "how"), "hang": ("seconds",), "desync": ("mode",), "corrupt": ("bits",),
                 "nan": (), "compute_corrupt": (), "common_mode": (), "aggregator_lie": ("how",), "checkpoint_crash": ("phase", "how"),
                 "checkpoint_corrupt": ("file",), **_MEMBERSHIP_OPTIONS}[self.kind]
        d = asdict(self)
        d["workers"] = list(self.workers)
        return {"id": self.id, "kind": self.kind, "rank": int(self.rank), "step": int(self.step),
                **{k: d[k] for k in extra}}


# --- membership faults (issue 17) ---------------------------------------------------------------
_MEMBERSHIP_OPTIONS: dict[str, tuple[str, ...]] = {"partition": ("workers", "seconds", "join_step"),
                                                   "rejoin": ("seconds", "join_step")}


def _membership_problems(fault: Fault) -> list[str]:
    """Normalise ``fault.workers`` (sorted distinct ints) and say what is wrong with a membership fault."""
    try:
        workers = tuple(sorted({int(w) for w in fault.workers}))
    except (TypeError, ValueError):
        return [f"fault {fault.id}: workers must be a list of worker ids; got {fault.workers!r}."]
    object.__setattr__(fault, "workers", workers)
    if int(fault.join_step) < 0 or (int(fault.join_step) and fault.kind not in MEMBERSHIP_KINDS):
        return [f"fault {fault.id}: join_step is a rejoin and partition option (>= 0; 0: whenever the replacement "
                f"is ready); got {fault.join_step}."]
    if 0 < int(fault.join_step) < int(fault.step):
        # the survivors admit the joiner after a step they complete once the worker is gone (they restore a
        # commit before `step` and replay): a boundary before `step` may already lie behind them, and they
        # would wait there for nothing
        return [f"fault {fault.id}: join_step={fault.join_step} is before the fault's step={fault.step}: the worker is "
                f"lost in step {fault.step}, so it can be admitted only after that step or a later one; use join_step >= "
                f"{fault.step}, or join_step=0 (whenever it is ready)."]
    if fault.kind != "partition":
        return [f"fault {fault.id}: workers is a partition option; remove it."] if workers else []
    if not workers or workers[0] < 0:
        return [f"fault {fault.id}: a partition needs the worker ids it cuts off (workers=[4,5]); got {list(workers)}."]
    return []


class PartitionedError(CollectiveError):
    """The injector blocked this process's collective across a partition (see :class:`Partition`).

    A real partition shows up as a collective timeout after ``collective_timeout_s``; the
    injector raises at once, on every process of both sides, so tests do not wait out timeouts.
    """


@dataclass(frozen=True)
class Partition:
    """The cut a ``partition`` fault made: what a process on one side can still reach.

    Attributes:
        fault: the fault's id. step: the 1-based step at which the cut happened.
        cut: the worker ids cut off. inside: this process hosts a worker of ``cut``.
    """

    fault: str
    step: int
    cut: tuple[int, ...]
    inside: bool

    def reachable(self, members: Sequence[int]) -> tuple[int, ...]:
        """The members on this process's side of the cut.

        Example:
            >>> Partition("p", 3, (4, 5), inside=True).reachable(range(6))
            (4, 5)
            >>> Partition("p", 3, (4, 5), inside=False).reachable(range(6))
            (0, 1, 2, 3)
        """
        return tuple(int(w) for w in members if (int(w) in self.cut) == self.inside)


def fired_faults(log: Optional[Path]) -> list[dict[str, Any]]:
    """The fault records in a fired-faults log (oldest first; ``[]`` without a log)."""
    return [] if log is None else read_jsonl(Path(log))


class FaultInjector:
    """Fires the configured faults at the hooks the trainer and the checkpointer call.

    Args:
        faults: the faults of the run (all of them: each process fires only those of the workers
            it hosts).
        worker_ids: ``{comm rank: worker id}`` of the workers this process hosts (the worker id is
            the rank in the original group; faults name worker ids).
        log: the fired-faults log shared by every rank (``None``: remember in memory only).
        process_rank: this process's rank (``rank-<r>.pt`` is its checkpoint file).
        attempt: restarts so far (recorded with each fired fault).

    Raises:
        ConfigError: two faults share an id.
    """

    def __init__(self, faults: Sequence[Fault], *, worker_ids: Mapping[int, int], log: Optional[Path] = None,
                 process_rank: int = 0, attempt: int = 0) -> None:
        ids = [f.id for f in faults]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ConfigError(f"fault ids must be unique within a run; repeated: {dup} (give them a name).")
        self.faults = list(faults)
        self.worker_ids = {int(k): int(v) for k, v in worker_ids.items()}
        self.log = None if log is None else Path(log)
        self.process_rank = int(process_rank)
        self.attempt = int(attempt)
        self.fired: set[str] = {str(r.get("id")) for r in fired_faults(self.log)}
        #: ``{worker id: the worker ids of its replica group}`` (set by ``protocol=redundant``; empty:
        #: a ``common_mode`` fault hits only its own worker).
        self.peers: dict[int, tuple[int, ...]] = {}
        self._common: dict[str, int] = {}  # common_mode fault id -> the step it fires at in this process
        #: The cut of a ``partition`` fault once it fired in this process (``None`` before).
        self.partition: Optional[Partition] = None

    # --- bookkeeping ---------------------------------------------------------------------------
    def has(self, kind: str) -> bool:
        """True when a fault of ``kind`` is configured (fired or not)."""
        return any(f.kind == kind for f in self.faults)

    def _take(self, kind: str, worker: int, step: int, **match: str) -> Optional[Fault]:
        for f in self.faults:
            if (f.kind == kind and int(f.rank) == worker and int(f.step) == step and f.id not in self.fired
                    and all(getattr(f, k) == v for k, v in match.items())):
                self.fired.add(f.id)
                record = {**f.describe(), "attempt": self.attempt, "time": time.time(), "pid": os.getpid()}
                if self.log is not None:
                    append_jsonl(self.log, record)  # durable before the fault takes effect
                return f
        return None

    def _mine(self, comm_rank: int) -> int:
        return self.worker_ids.get(int(comm_rank), -1)

    def _process_worker(self) -> int:
        return self.worker_ids.get(self.process_rank, min(self.worker_ids.values(), default=-1))

    @staticmethod
    def _die(how: str) -> None:
        if how == "exit":
            os._exit(_EXIT_CODE)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # pragma: no cover - the signal is delivered before this returns

    # --- trainer hooks ---------------------------------------------------------------------------
    def step_point(self, where: str, step_id: int) -> None:
        """``crash`` faults of the hosted workers at ``where`` of the step with 0-based id ``step_id``
        (and, at ``before_step``, a ``partition`` fault of that step: see :meth:`cut`)."""
        if where == "before_step":
            self.cut(step_id)
            for r in sorted(self.worker_ids):
                if self._take("rejoin", self._mine(r), step_id + 1) is not None:
                    self._die("sigkill")  # its replacement comes back after `seconds` (the launcher)
        for r in sorted(self.worker_ids):
            f = self._take("crash", self._mine(r), step_id + 1, where=where)
            if f is not None:
                self._die(f.how)

    def cut(self, step_id: int) -> None:
        """``partition`` faults: at the start of step ``step_id + 1`` every process blocks its collectives.

        Every process fires the fault (each knows the cut); only the one hosting the lowest cut-off
        worker logs it, so the fired-faults log holds it once.

        Raises:
            PartitionedError: the fault of this step fired (on every process of both sides).
        """
        for f in self.faults:
            if f.kind != "partition" or int(f.step) != step_id + 1 or f.id in self.fired:
                continue
            mine = set(self.worker_ids.values())
            if min(f.workers) in mine:
                self._take("partition", int(f.rank), int(f.step))
            self.fired.add(f.id)
            inside = bool(mine & set(f.workers))
            self.partition = Partition(f.id, int(f.step), tuple(f.workers), inside)
            other = "the others" if inside else f"workers {sorted(f.workers)}"
            raise PartitionedError(f"partition {f.id} at step {f.step}: the collective with {other} is blocked "
                                   f"(injected; a real partition times out after the collective timeout)")

    def before_announce(self, trainer: _HasComm, step_id: int) -> int:
        """``desync`` faults: returns the step id this process announces (``skip`` shifts the counter)."""
        announced = step_id
        for r in sorted(self.worker_ids):
            f = self._take("desync", self._mine(r), step_id + 1)
            if f is None:
                continue
            if f.mode == "skip":
                trainer.comm.seq += 1  # as if this rank had issued (or skipped) one collective more
            else:
                announced = step_id + 1  # this rank runs the next step's exchange first
        return announced

    def compute(self, step_id: int, comm_rank: int) -> None:
        """``hang`` faults: stall inside the worker's timed compute window."""
        f = self._take("hang", self._mine(comm_rank), step_id + 1)
        if f is not None:
            time.sleep(float(f.seconds))

    def submission(self, step_id: int, comm_rank: int, g: torch.Tensor) -> torch.Tensor:
        """``nan`` faults: a copy of ``g`` with one coordinate (chosen from ``(rank, step)``) set to NaN;
        ``compute_corrupt`` and ``common_mode``: a copy with one coordinate shifted by ``+1.0``
        (before the checksum is taken: the integrity layer cannot see it)."""
        me = self._mine(comm_rank)
        f = self._take("nan", me, step_id + 1)
        if f is not None:
            g = g.clone()
            g.view(-1)[mix_seed(int(f.rank), int(f.step), 0x7A7) % max(1, g.numel())] = float("nan")
        f = self._take("compute_corrupt", me, step_id + 1)
        if f is not None:
            g = self._shift(g, f)
        for f in self._common_mode(me, step_id + 1):
            g = self._shift(g, f)
        return g

    @staticmethod
    def _shift(g: torch.Tensor, f: Fault) -> torch.Tensor:
        """A copy of ``g`` with the coordinate chosen from the fault's ``(rank, step)`` shifted by ``+1.0``:
        the same bits from the same ``g`` on every replica."""
        g = g.clone()
        g.view(-1)[mix_seed(int(f.rank), int(f.step), 0xCC) % max(1, g.numel())] += 1.0
        return g

    def _common_mode(self, worker: int, step: int) -> list[Fault]:
        """The ``common_mode`` faults that hit ``worker`` at ``step``: its own or its group's (each fires
        once per run; every hosted replica of the group gets it at that step)."""
        hit = []
        for f in self.faults:
            if f.kind != "common_mode" or int(f.step) != step:
                continue
            if worker != int(f.rank) and worker not in self.peers.get(int(f.rank), ()):
                continue
            if self._common.get(f.id) == step:
                hit.append(f)  # fired in this process at this step: the next hosted replica gets it too
                continue
            if f.id in self.fired:
                continue
            self.fired.add(f.id)
            self._common[f.id] = step
            record = {**f.describe(), "attempt": self.attempt, "time": time.time(), "pid": os.getpid()}
            if self.log is not None:
                append_jsonl(self.log, record)
            hit.append(f)
        return hit

    def lie(self, step_id: int, comm_rank: int) -> Optional[Fault]:
        """The ``aggregator_lie`` fault of hosted worker ``comm_rank`` at 0-based step ``step_id`` (fires once), or ``None``.

        The reduction applies it with :meth:`lied` to every aggregate slice that rank hands on at that step.
        """
        return self._take("aggregator_lie", self._mine(comm_rank), step_id + 1)

    @staticmethod
    def lied(fault: Fault, values: torch.Tensor, previous: Optional[torch.Tensor]) -> torch.Tensor:
        """A wrong copy of an aggregate slice ``values`` (``(d_s,)``, floating) as ``fault.how`` says.

        ``previous``: the same coordinates of the previous step's aggregate (``stale``; ``None``:
        zeros). ``last_bits`` flips the lowest bit of one coordinate, chosen from the fault's
        ``(rank, step)``. An empty slice stays empty (there is nothing to lie about).
        """
        out = values.clone()
        if out.numel() == 0:
            return out
        if fault.how == "scale":
            return out.mul_(2.0)
        if fault.how == "sign_flip":
            return out.neg_()
        if fault.how == "stale":
            return torch.zeros_like(out) if previous is None else previous.to(out).clone()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
        out.view(ints).view(-1)[mix_seed(int(fault.rank), int(fault.step), 0x11E) % out.numel()] ^= 1
        return out

    def tamper(self, step_id: int, comm_rank: int, frame: torch.Tensor) -> torch.Tensor:
        """``corrupt`` faults: a copy of the ``uint8`` frame with ``bits`` bits of its body flipped.

        The last 8 bytes (the checksum trailer) are left alone, so the receiver's recomputed
        checksum disagrees with the declared one. Bit positions derive from ``(rank, step)``.
        """
        f = self._take("corrupt", self._mine(comm_rank), step_id + 1)
        if f is None:
            return frame
        out = frame.clone()
        body = max(1, out.numel() - 8)
        flat = out.view(-1)
        for i in range(int(f.bits)):
            pos = mix_seed(int(f.rank), int(f.step), 0xC0, i) % (body * 8)
            flat[pos // 8] ^= 1 << (pos % 8)
        return out

    # --- checkpoint hooks ------------------------------------------------------------------------
    def checkpoint_files(self, step: int, staging: Path) -> None:
        """``checkpoint_crash`` (``phase=files``): leave a half-written temp file, then die."""
        f = self._take("checkpoint_crash", self._process_worker(), step, phase="files")
        if f is None:
            return
        tmp = Path(staging) / f".rank-{self.process_rank}.pt.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(b"PK\x03\x04 half-written checkpoint file")
            fh.flush()
            os.fsync(fh.fileno())
        self._die(f.how)

    def checkpoint_commit(self, step: int, staging: Path) -> None:
        """``checkpoint_crash`` (``phase=commit``, rank 0): die after the manifest, before the rename."""
        f = self._take("checkpoint_crash", self._process_worker(), step, phase="commit")
        if f is not None:
            self._die(f.how)

    def checkpoint_committed(self, step: int, path: Path) -> None:
        """``checkpoint_corrupt``: flip one byte in the middle of a committed file on disk;
        ``crash`` with ``where="after_commit"``: die right after the commit."""
        crash = self._take("crash", self._process_worker(), step, where="after_commit")
        if crash is not None:
            self._die(crash.how)
        f = self._take("checkpoint_corrupt", self._process_worker(), step)
        if f is None:
            return
        target = Path(path) / (f.file or f"rank-{self.process_rank}.pt")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        with open(target, "r+b") as fh:  # damage in place: the manifest's SHA-256 no longer matches
            fh.write(bytes(data))
            fh.flush()
            os.fsync(fh.fileno())
