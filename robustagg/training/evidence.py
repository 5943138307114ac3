"""Failure evidence and the straggler report.

On any failure, each surviving rank writes ``evidence/rank-<r>.json`` before the group is torn
down (:func:`write_evidence`): the failure kind, the step, the last completed and the in-flight
collective (group id, sequence number, op, shape, dtype, start time, deadline), when every rank was
last heard from, the digests exchanged, and the exception text. :func:`summarise_evidence` turns
the files of one failed attempt into one *detection* record for the run's report.

:class:`StragglerLog` keeps every rank's compute time and arrival time per step (they travel in the
step headers) and reports p50/p99 per rank; a step where one rank took far longer than the step's
median, or where the others waited far longer than that for it at the exchange, is flagged as a
straggler naming that rank.
"""

from __future__ import annotations

import json
import math
import re
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np

from ..checkpoint import atomic_write_json, read_regular
from ..errors import (AssumptionError, CheckpointError, DesyncError, IntegrityError, Interrupted, LyingAggregatorError,
                      NonFiniteInputError, QuorumLostError)

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import Trainer

__all__ = ["failure_kind", "build_evidence", "write_evidence", "read_evidence", "summarise_evidence",
           "StragglerLog"]

#: From most to least specific: the kind a detection record reports when ranks saw different ones.
_PRIORITY = ("lying_aggregator", "desync", "corruption", "nonfinite", "requirement", "checkpoint", "partition", "quorum_lost", "error", "timeout", "peer_lost",
             "terminated", "interrupted")


def failure_kind(exc: BaseException) -> str:
    """Classify an exception: ``lying_aggregator`` (the aggregate cross-check named ranks to exclude,
    :class:`~robustagg.errors.LyingAggregatorError`), ``desync``, ``corruption``, ``nonfinite``, ``requirement``,
    ``checkpoint``, ``partition`` (an injected cut blocked the collective), ``quorum_lost`` (this side
    holds no strict majority of the membership), ``timeout`` / ``peer_lost`` (a collective failed: timed out, or a peer's
    connection closed), ``terminated`` (SIGTERM during a teardown), ``interrupted`` (a requested stop,
    :class:`~robustagg.errors.Interrupted`: not a failure) or ``error``.

    Example:
        >>> from robustagg.errors import DesyncError
        >>> failure_kind(DesyncError("seq")), failure_kind(ValueError("x"))
        ('desync', 'error')
    """
    from ..distributed.comm import CollectiveError
    from ..distributed.launch import TerminatedError

    if isinstance(exc, LyingAggregatorError):
        return "lying_aggregator"
    if isinstance(exc, DesyncError):
        return "desync"
    if isinstance(exc, NonFiniteInputError):
        return "nonfinite"
    if isinstance(exc, IntegrityError):
        return "corruption"
    if isinstance(exc, AssumptionError):
        return "requirement"
    if isinstance(exc, CheckpointError):
        return "checkpoint"
    if isinstance(exc, TerminatedError):
        return "terminated"
    from .faults import PartitionedError

    if isinstance(exc, QuorumLostError):
        return "quorum_lost"
    if isinstance(exc, PartitionedError):
        return "partition"
    if isinstance(exc, Interrupted):
        return "interrupted"
    if isinstance(exc, CollectiveError):
        return "timeout" if re.search(r"time[sd]? ?out|timeout", str(exc), re.IGNORECASE) else "peer_lost"
    return "error"


def build_evidence(trainer: "Trainer", exc: BaseException, **extra: Any) -> dict[str, Any]:
    """The evidence of one rank about a failure (a JSON-ready dict; see the module docstring).

    Keys: ``rank``, ``workers`` (worker ids hosted), ``kind``, ``step`` (1-based number of the step
    in flight, or the last completed one outside a step), ``step_id`` (completed steps),
    ``in_step``, ``time``, ``group``, ``world_size``, ``collective`` (``last_completed`` and
    ``in_flight`` records), ``heartbeats`` (``{rank: {"step", "time"}}`` from the last header
    exchange: when each rank was last heard from), ``digests`` (previous-aggregate digest each
    rank announced, this rank's last aggregate, parameter and optimizer-state digests),
    ``exception`` (type, message, traceback), plus ``extra``.
    """
    comm = trainer.comm
    last, done = comm.last, comm.last_completed
    in_flight = last if last is not None and last.finished is None else None
    heard = {}
    if trainer.last_headers:
        heard = {str(h.rank): {"step": h.step + 1, "time": trainer.last_headers_at} for h in trainer.last_headers}
    digests: dict[str, Any] = {"last_aggregate": trainer.reduction.last_digest,
                               "announced_prev_aggregate": {str(h.rank): h.prev_digest for h in trainer.last_headers}}
    for name, fn in (("parameters", trainer.parameter_digest), ("optimizer", trainer.optimizer_digest)):
        try:
            digests[name] = fn()
        except Exception:  # pragma: no cover - evidence must not fail
            digests[name] = None
    cur = trainer.current_step
    return {
        "rank": comm.rank, "workers": [trainer.identities[r] for r in comm.local_ranks],
        "kind": failure_kind(exc), "step": (cur + 1) if cur is not None else trainer.step_id,
        "step_id": trainer.step_id, "in_step": cur is not None, "time": time.time(),
        "group": comm.group_id, "world_size": comm.world_size,
        "collective": {"last_completed": None if done is None else done.as_dict(),
                       "in_flight": None if in_flight is None else in_flight.as_dict(),
                       "seq": comm.seq, "timeout_s": comm.timeout_s},
        "heartbeats": heard, "digests": digests,
        "exception": {"type": type(exc).__name__, "message": str(exc),
                      "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))},
        **extra,
    }


def write_evidence(folder: Path, trainer: "Trainer", exc: BaseException, **extra: Any) -> Path:
    """Write :func:`build_evidence` to ``folder/rank-<r>.json`` atomically; returns the path."""
    path = Path(folder) / f"rank-{trainer.comm.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, _clean(build_evidence(trainer, exc, **extra)))
    return path


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


#: An evidence file's name: ``rank-<r>.json`` with ``r`` in ASCII decimal digits.
_EVIDENCE_NAME = re.compile(r"rank-(0|[1-9][0-9]{0,8})\.json", re.ASCII)
#: Larger files are not evidence a rank wrote (one holds a traceback and a few digests: kilobytes).
_EVIDENCE_MAX_BYTES = 16 * 2**20


def read_evidence(folder: Path) -> list[dict[str, Any]]:
    """Every well-formed ``rank-<r>.json`` evidence file in ``folder``, in rank order.

    The folder is untrusted input: anything may have been placed there. A file is kept only when
    its name is ``rank-<r>.json`` with ``r`` in ASCII decimal digits, it is a regular file of at most
    16 MiB (read by :func:`robustagg.checkpoint.read_regular`: no symlink followed) holding a
    JSON object nested shallowly enough to parse, its ``rank`` field (when present) equals ``r`` (a bool is not a
    rank), ``kind`` is a string, ``step`` an integer or null, ``step_id`` an integer and ``time`` a
    number, where present. Every other file is skipped, so :func:`summarise_evidence` and the
    readers of ``step_id`` and ``time`` never fail on what this returns. ``rank`` is set from the
    file name when missing.

    Args:
        folder: the evidence folder of one attempt (need not exist: then ``[]``).

    Returns:
        The evidence dicts (see :func:`build_evidence`), sorted by rank. Raises nothing.
    """
    found: list[tuple[int, dict[str, Any]]] = []
    try:
        paths = list(Path(folder).iterdir())
    except OSError:
        return []
    for p in paths:
        m = _EVIDENCE_NAME.fullmatch(p.name)
        if m is None:
            continue
        rank = int(m.group(1))
        try:
            record = json.loads(read_regular(Path(folder), p.name, limit=_EVIDENCE_MAX_BYTES).decode())
        except (CheckpointError, ValueError, RecursionError):  # not a plain file, too large, not JSON, too deep
            continue
        if _well_formed(record, rank):
            found.append((rank, {**record, "rank": rank}))
    return [record for _, record in sorted(found, key=lambda item: item[0])]


def _well_formed(record: Any, rank: int) -> bool:
    """Whether one decoded evidence file has the field types its readers rely on (see read_evidence)."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(record, dict):
        return False
    if "rank" in record and not (is_int(record["rank"]) and record["rank"] == rank):
        return False
    if "kind" in record and not isinstance(record["kind"], str):
        return False
    if "step" in record and record["step"] is not None and not is_int(record["step"]):
        return False
    if "step_id" in record and not is_int(record["step_id"]):
        return False
    if "time" in record and not (isinstance(record["time"], (int, float)) and not isinstance(record["time"], bool)):
        return False
    exception = record.get("exception", {})
    return isinstance(exception, dict) and isinstance(exception.get("message", ""), str)


def summarise_evidence(evidence: Sequence[dict[str, Any]], *, attempt: int, lost: Sequence[int] = (),
                       message: str = "") -> dict[str, Any]:
    """One detection record from the evidence files of a failed attempt.

    The kind is the most specific one any rank reported (a desync seen by every rank beats the
    timeouts it caused); the step is the earliest step any rank reported for that kind.

    Returns:
        ``{"attempt", "kind", "step", "ranks" (that wrote evidence), "kinds" ({rank: kind}),
        "lost" (ranks gone without evidence), "message"}``.

    Example:
        >>> ev = [{"rank": 0, "kind": "peer_lost", "step": 5}, {"rank": 1, "kind": "desync", "step": 4}]
        >>> r = summarise_evidence(ev, attempt=0); (r["kind"], r["step"], r["ranks"])
        ('desync', 4, [0, 1])
    """
    kinds = {int(e["rank"]): str(e.get("kind", "error")) for e in evidence}
    present = [k for k in _PRIORITY if k in kinds.values()]
    kind = present[0] if present else ("fail-stop" if lost else "unknown")
    steps = [int(e["step"]) for e in evidence if e.get("kind") == kind and e.get("step") is not None]
    if kind in ("peer_lost", "timeout", "terminated") and lost:
        kind = "fail-stop"
    first = next((e for e in evidence if e.get("kind") == present[0]), None) if present else None
    text = message or (first or {}).get("exception", {}).get("message", "")
    return {"attempt": int(attempt), "kind": kind, "step": min(steps) if steps else None,
            "ranks": sorted(kinds), "kinds": {str(k): v for k, v in sorted(kinds.items())},
            "lost": sorted(int(r) for r in lost), "message": str(text).splitlines()[0][:500] if text else ""}


class StragglerLog:
    """Per-rank compute time and lateness of every step, with a straggler flag.

    Two measurements per step, both from the step headers (no extra collective):

    - **compute**: each rank's own compute time before the exchange; rank r is flagged when it
      exceeds ``factor`` times the median of that step's times and ``min_seconds``;
    - **waiting**: each rank's wall-clock arrival time at the header exchange. The exchange ends
      when the last rank arrives, so the rank everyone waited for is the one that arrived last,
      and ``waited_s`` (how long the others waited for rank r) is the median over the other
      ranks q of ``max(0, arrival_r - arrival_q)``. The last rank is flagged when its ``waited_s``
      exceeds ``min_seconds`` and ``factor`` times the median *step period* of the steps before
      (the time between two consecutive exchanges, i.e. between their last arrivals): the others
      waited for it longer than ``factor`` normal steps. This catches a stall outside the compute
      window (a paused process, a slow data load, a GC pause) that compute times do not show,
      without flagging the main rank's routine per-step logging (and, through ``excused``, its
      evaluations). It needs one period recorded
      before the step (from the third step of a log on). Arrival times on different hosts differ
      by their clock skew.

    One record per flagged (step, rank): ``{"step", "rank", "seconds" (its compute time),
    "median_s" (the step's median compute time), "waited_s", "cause"}``, ``cause`` being
    ``"compute"`` (its compute time was long) or ``"outside compute"`` (only its arrival was late).

    Args:
        factor: how many medians make a straggler (> 1).
        min_seconds: ignore stalls shorter than this (timer noise on tiny models), in seconds.

    In the example, steps come every 0.25 s; rank 1 computes 0.9 s at step 3; rank 2 arrives late
    at step 4 with a normal compute time (the periods before step 4 are 0.25 s and 1.25 s, median
    0.75 s; with step 4's own 4.75 s, the median period is 1.25 s).

    Example:
        >>> log = StragglerLog(factor=5, min_seconds=0.1)
        >>> log.add(1, [0.01, 0.01, 0.01], arrivals=[100.0, 100.0, 100.0])
        []
        >>> log.add(2, [0.01, 0.01, 0.01], arrivals=[100.25, 100.25, 100.25])  # one period: 0.25 s
        []
        >>> log.add(3, [0.01, 0.9, 0.01], arrivals=[100.5, 101.5, 100.5])  # waited 1.0 s < 5 x 0.25 s
        [{'step': 3, 'rank': 1, 'seconds': 0.9, 'median_s': 0.01, 'waited_s': 1.0, 'cause': 'compute'}]
        >>> log.add(4, [0.01, 0.01, 0.01], arrivals=[101.75, 102.25, 106.25])  # waits 4.5, 4.0: median 4.25 > 5 x 0.75
        [{'step': 4, 'rank': 2, 'seconds': 0.01, 'median_s': 0.01, 'waited_s': 4.25, 'cause': 'outside compute'}]
        >>> rep = log.report()
        >>> rep["per_rank"]["1"]["max_s"], rep["per_rank"]["2"]["waited_for_max_s"], rep["period_p50_s"]
        (0.9, 4.25, 1.25)
    """

    def __init__(self, factor: float = 10.0, min_seconds: float = 0.05) -> None:
        self.factor = float(factor)
        self.min_seconds = float(min_seconds)
        self.times: dict[int, list[float]] = {}
        self.waited_for: dict[int, list[float]] = {}
        self.periods: list[float] = []
        self._last_exchange = math.nan
        self.flagged: list[dict[str, Any]] = []

    @staticmethod
    def waits(arrivals: Sequence[float]) -> list[float]:
        """How long the other ranks waited for each rank: ``median_q!=r max(0, a_r - a_q)``, in seconds
        (0 with one rank; NaN for a rank whose arrival time is not finite).

        Example:
            >>> StragglerLog.waits([10.0, 10.5, 13.5])
            [0.0, 0.25, 3.25]
        """
        a = [float(x) for x in arrivals]
        out = []
        for r, ar in enumerate(a):
            others = [max(0.0, ar - q) for i, q in enumerate(a) if i != r and math.isfinite(q)]
            out.append(math.nan if not math.isfinite(ar) else float(np.median(others)) if others else 0.0)
        return out

    def add(self, step: int, seconds: Sequence[float], arrivals: Optional[Sequence[float]] = None,
            excused: Optional[Mapping[int, float]] = None) -> list[dict[str, Any]]:
        """Record one step (1-based number) of per-rank compute seconds and, optionally, arrival times
        (``time.time()`` seconds, one per rank); returns the stragglers it flags (see the class).

        Args:
            step: the step's 1-based number. seconds: compute seconds per rank.
            arrivals: arrival times at the step's header exchange, one per rank (``None``: compute only).
            excused: ``{rank: seconds}`` of known duties that delayed a rank's arrival (the main
                rank's logging and evaluation of the previous step), subtracted from ``waited_s``
                before the flag decision; the record keeps the measured ``waited_s``.

        Raises:
            ValueError: ``arrivals`` does not have one entry per rank.
        """
        vals = [float(s) for s in seconds]
        if arrivals is not None and len(arrivals) != len(vals):
            raise ValueError(f"StragglerLog.add: arrivals needs one time per rank ({len(vals)}); got {len(arrivals)}.")
        waited = self.waits(arrivals) if arrivals is not None else [math.nan] * len(vals)
        excuse = [float((excused or {}).get(r, 0.0)) for r in range(len(vals))]
        for r, s in enumerate(vals):
            if math.isfinite(s):
                self.times.setdefault(r, []).append(s)
            if math.isfinite(waited[r]):
                self.waited_for.setdefault(r, []).append(waited[r])
        period = float(np.median(self.periods)) if self.periods else math.nan
        times = [float(a) for a in arrivals or () if math.isfinite(float(a))]
        if times:
            exchange = max(times)
            if math.isfinite(self._last_exchange):
                self.periods.append(exchange - self._last_exchange)
            self._last_exchange = exchange
        finite = [s for s in vals if math.isfinite(s)]
        if not finite:
            return []
        med = float(np.median(finite))
        known = [r for r in range(len(vals)) if math.isfinite(waited[r])]
        last = max(known, key=lambda r: waited[r]) if known else -1  # the rank everyone waited for
        new = []
        for r, s in enumerate(vals):
            slow = math.isfinite(s) and s > self.factor * med and s > self.min_seconds
            unexplained = waited[r] - excuse[r]
            late = (r == last and math.isfinite(period) and unexplained > self.factor * period
                    and unexplained > self.min_seconds)
            if slow or late:
                new.append({"step": int(step), "rank": r, "seconds": s, "median_s": med, "waited_s": waited[r],
                            "cause": "compute" if slow else "outside compute"})
        self.flagged.extend(new)
        return new

    def report(self) -> dict[str, Any]:
        """``{"p50_s", "p99_s" (compute, over every rank-step), "period_p50_s" (median step period),
        "per_rank": {rank: {"p50_s", "p99_s", "max_s", "steps", "waited_for_max_s"}}, "stragglers":
        [flagged steps], "factor", "min_seconds"}``."""
        every = [s for v in self.times.values() for s in v]

        def pct(v: list[float], q: float) -> float:
            return float(np.percentile(v, q)) if v else math.nan

        return {"p50_s": pct(every, 50), "p99_s": pct(every, 99), "period_p50_s": pct(self.periods, 50),
                "per_rank": {str(r): {"p50_s": pct(v, 50), "p99_s": pct(v, 99), "max_s": max(v), "steps": len(v),
                                      "waited_for_max_s": max(self.waited_for.get(r, [math.nan]))}
                             for r, v in sorted(self.times.items())},
                "stragglers": list(self.flagged), "factor": self.factor, "min_seconds": self.min_seconds}
