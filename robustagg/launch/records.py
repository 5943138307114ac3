"""The supervisor's bookkeeping between attempts: what each start is told, failures, and run records.

- :class:`Attempt`: what the launcher tells every worker about this start of the group.
- :func:`record_failure`: after a failed attempt, the survivors' evidence becomes one detection
  record (``detections.jsonl``) and is archived (``evidence/attempt-<k>/``).
- :func:`settle_metrics`: on every start, ``metrics.jsonl`` is cut back to the restored step and
  de-duplicated, so every train step and every evaluation appears exactly once.
- :func:`summary_from_records`: the trajectory-wide summary over every record of the run.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..checkpoint import append_jsonl, atomic_write_bytes, read_jsonl
from ..training.evidence import read_evidence, summarise_evidence

__all__ = ["Attempt", "DETECTIONS_KEPT", "detected_faults", "last_step_reached", "record_failure", "settle_metrics",
           "summary_from_records"]

DETECTIONS_KEPT = 100


@dataclass
class Attempt:
    """One start of the worker group, as the launcher tells every worker.

    Attributes:
        number: restarts so far (0: the first start).
        reason: why this start happened (the failure that ended the previous attempt).
        resume: ``auto``, ``never`` or a checkpoint folder (restarts always use ``auto``).
        fallback: a checkpoint folder ``auto`` uses when the run's folder holds none yet.
        last_step: the highest step the previous attempt reached (for ``steps_replayed``).
        shrink: the lineage record of the elastic shrink that preceded this start, or ``None``.
        changes: an experiment change accepted before launch (``resume_changes=allow``), recorded
            in the first restore's lineage record.
        membership: where the committed membership lives and which epoch this start runs under,
            ``{"host", "port", "epoch"}`` (the launcher's store; see :mod:`~robustagg.launch.quorum`),
            or ``None`` (no membership store: ``on_failure=restart``, torchrun, simulated).
        joiners: replacements the launcher starts next to this attempt's workers, one per lost
            worker id (``trainer.rejoin``): ``{"worker", "byzantine", "after_s"}`` each
            (:mod:`~robustagg.launch.grow`).
    """

    number: int = 0
    reason: str = ""
    resume: str = "auto"
    fallback: str = ""
    last_step: Optional[int] = None
    shrink: Optional[dict[str, Any]] = None
    changes: Optional[dict[str, Any]] = None
    membership: Optional[dict[str, Any]] = None
    joiners: list[dict[str, Any]] = field(default_factory=list)


def detected_faults(records: list[dict[str, Any]], *, keep: int = DETECTIONS_KEPT) -> dict[str, Any]:
    """The summary's account of ``detections.jsonl``: its first ``keep`` records and the counts.

    A persistent fault (a Byzantine replica outvoted at every step, a straggler) adds a record per
    step; the summary keeps its size bounded and says how many it left to the file.

    Returns:
        ``{"detected": records[:keep], "detected_count": len(records), "detected_by_kind":
        {kind: count}, "detected_truncated": len(records) > keep}``.
    """
    by_kind: dict[str, int] = {}
    for r in records:
        k = str(r.get("kind", "unknown"))
        by_kind[k] = by_kind.get(k, 0) + 1
    return {"detected": records[:keep], "detected_count": len(records), "detected_by_kind": by_kind,
            "detected_truncated": len(records) > keep}


def last_step_reached(out_dir: Path) -> int:
    """The highest step in ``metrics.jsonl`` and the evidence files of ``out_dir`` (0 if none)."""
    steps = [int(r.get("step", 0)) for r in read_jsonl(Path(out_dir) / "metrics.jsonl") if r.get("kind") == "train"]
    steps += [int(e.get("step_id", 0)) for e in read_evidence(Path(out_dir) / "evidence")]
    return max(steps, default=0)


def record_failure(out_dir: Path, attempt: int, *, lost: list[int], message: str, archive: bool) -> dict[str, Any]:
    """Append the detection record of a failed attempt to ``detections.jsonl``; archive its evidence.

    Args:
        out_dir: the run directory (``evidence/`` and ``detections.jsonl`` live there).
        attempt: the failed attempt's number.
        lost: worker ids gone without evidence (killed, exited, terminated).
        message: the launcher's one-line account of the failure.
        archive: move ``evidence/rank-*.json`` to ``evidence/attempt-<k>/`` (a restart follows).

    Returns:
        the detection record (see :func:`robustagg.training.summarise_evidence`), with ``time``:
        when the launcher recorded it (``time.time()`` seconds, after the group was torn down).
    """
    folder = Path(out_dir) / "evidence"
    evidence = read_evidence(folder)
    record = summarise_evidence(evidence, attempt=attempt, lost=lost)
    record.update({"source": "failure", "launcher": message.splitlines()[0][:500] if message else "",
                   "time": time.time()})
    append_jsonl(Path(out_dir) / "detections.jsonl", record)
    if archive and evidence:
        dest = folder / f"attempt-{attempt}"
        dest.mkdir(parents=True, exist_ok=True)
        for p in folder.glob("rank-*.json"):
            shutil.move(str(p), str(dest / p.name))
    return record


def settle_metrics(path: Path, step: int) -> int:
    """Make ``metrics.jsonl`` the record of the restored trajectory: steps ``<= step``, each once.

    Called on every start of the group (rank 0, after the restore), so a record written by an
    attempt that died after it (steps beyond the restored checkpoint, which will be replayed) and
    a duplicate (the same ``(kind, step)`` written twice by a kill between a record and the next
    commit) are gone before the run appends again. The first occurrence of each ``(kind, step)``
    is kept. Atomic (temp file, fsync, rename); a torn last line is dropped.

    Returns:
        the number of records removed.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    records = read_jsonl(path)
    seen: set[tuple[str, int]] = set()
    keep = []
    for r in records:
        key = (str(r.get("kind")), int(r.get("step", 0)))
        if key[1] > step or key in seen:
            continue
        seen.add(key)
        keep.append(r)
    raw = path.read_bytes()
    lines = sum(1 for line in raw.splitlines() if line.strip())
    if len(keep) != lines:
        atomic_write_bytes(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in keep).encode())
    return lines - len(keep)


def summary_from_records(summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Recompute the trajectory-wide summary fields from every record of ``metrics.jsonl`` (in place)."""

    def mean(vals: list[Any]) -> float:
        v = [float(x) for x in vals if isinstance(x, (int, float)) and math.isfinite(float(x))]
        return sum(v) / len(v) if v else math.nan

    train = [r for r in records if r.get("kind") == "train"]
    tests = [r for r in records if r.get("kind") == "test"]
    summary["mean_kappa_hat"] = mean([r.get("agg/kappa_hat") for r in train])
    summary["byz_accepted_rate"] = mean([r["agg/byz_accepted"] for r in train if "agg/byz_accepted" in r])
    summary["dropped_rows"] = int(sum(int(r.get("agg/dropped", 0)) for r in train))
    # protocols with partial participation or staleness (docs/protocols.md): their obligations
    if any("round/participants" in r for r in train):
        summary["mean_participants"] = mean([r.get("round/participants") for r in train])
        summary["rounds_without_guarantee"] = int(sum(int(r.get("round/over_f", 0)) for r in train))
        summary["byzantine_submissions"] = int(sum(int(r.get("round/byzantine", 0)) for r in train))
    if any("round/staleness_mean" in r for r in train):
        summary["mean_staleness"] = mean([r.get("round/staleness_mean") for r in train])
        summary["max_staleness_seen"] = max(int(r.get("round/staleness_max", 0)) for r in train)
        summary["discarded_rows"] = int(sum(int(r.get("round/discarded", 0)) for r in train))
    if any("vote/groups" in r for r in train):  # protocol=redundant: the replica vote
        summary["vote_disagreements"] = int(sum(int(r.get("vote/disagreements", 0)) for r in train))
        summary["vote_no_majority"] = int(sum(int(r.get("vote/no_majority", 0)) for r in train))
        summary["mean_vote_groups"] = mean([r.get("vote/groups") for r in train])
    if any("agg/bias_vs_sync" in r for r in train):
        summary["mean_bias_vs_sync"] = mean([r.get("agg/bias_vs_sync") for r in train])
        summary["mean_bias_vs_sync_rel"] = mean([r.get("agg/bias_vs_sync_rel") for r in train])
    accs = [r["test/acc"] for r in tests if isinstance(r.get("test/acc"), (int, float))]
    if accs:
        summary["best_test_acc"] = max(accs)
