"""Recovery measured: checkpoint overhead per step, and what a real crash costs (detect, restore, replay).

``python -m experiments.bench_recovery`` (config ``conf/bench_recovery/bench_recovery.yaml``;
``make bench-recovery``) writes two tables, printed and as CSV in the Hydra run directory:

**Checkpoint overhead** (``overhead.csv``, :data:`OVERHEAD_COLUMNS`), for every model of
``overhead.models`` and every interval ``k`` of ``overhead.every`` (``0``: checkpointing off).
A simulated-mode :class:`~robustagg.training.Trainer` of the experiment (``n`` workers in this
process, as :func:`experiments.bench_train.build_trainer` builds it) runs ``trainer.step()`` +
:func:`~robustagg.training.step_record` (what :func:`~robustagg.training.fit` does per step) and,
when due, the library's own :meth:`~robustagg.training.Checkpointer.save` into a
:class:`~robustagg.checkpoint.CheckpointStore` under the run directory (a real disk, real fsync).
The rounds are interleaved over the intervals (``repeats`` rounds of ``steps`` steps each), so a
change of machine load hits every interval alike. Reported per interval:

- ``step_ms``: mean time of a step without its checkpoint; ``save_ms``: mean time of one save;
- ``overhead_pct`` = 100 × (Σ save time / steps) / (Σ step time / steps): the checkpoint cost
  amortised over the interval, as a percentage of step time (the figure CheckFreq reports:
  Mohan et al., "CheckFreq: Frequent, Fine-Grained DNN Checkpointing", FAST 2021, ≤ 3.5 %);
- ``measured_pct``: 100 × (mean step + save time at ``k``, minus the mean step time with
  checkpointing off) / the latter. The direct difference; noisier on a shared machine;
- the split of one save (:class:`SaveSplit`, mean ms per save): ``snapshot_ms``
  (``trainer.state_dict()``: copies of every tensor), ``serialise_ms`` (``torch.save`` to bytes),
  ``write_fsync_ms`` (temp file, write, fsync, rename, folder fsync of the state files),
  ``commit_ms`` (rank 0's :meth:`~robustagg.checkpoint.CheckpointStore.commit`: read every file
  back and hash it, write the manifest, rename the folder, ``LATEST``, prune) and ``other_ms``
  (the rest: votes, staging folder, lineage read); ``state_mb``: bytes of one committed checkpoint.

**Recovery** (``recovery.csv``: every round; ``recovery_median.csv``: the medians over the rounds,
as printed; :data:`RECOVERY_COLUMNS`): real runs of ``python -m experiments.train``
(``trainer.mode=processes``, one OS process per worker, called in this process with
:func:`experiments.train.train`) of the same length, ``crash.repeats`` rounds of: one unfaulted,
and for each case of ``crash.cases`` one where worker ``crash.rank`` is SIGKILLed at the start of
step ``crash.step`` (the existing ``crash`` / ``rejoin`` faults):

- ``restart``: ``trainer.on_failure=restart``: the group is stopped and started again, every
  rank restores the newest committed checkpoint from disk, steps after it are replayed;
- ``rejoin``: ``trainer.on_failure=shrink`` + ``trainer.rejoin=true``: the survivors restart
  from disk as a smaller group, and the lost worker's replacement joins them at a step boundary
  with the state of a live peer (:mod:`robustagg.launch.grow`).

- ``shard_checkpoint``, ``shard_copy``, ``shard_parity``: sharded optimizer state
  (``trainer.reduction=sharded``, ``trainer.state_sharding=optimizer``, ``optimizer=adam``) and
  ``trainer.on_failure=shrink``; the lost rank's shard comes from the last commit (re-sliced, the
  steps since it replayed), from a redundant copy (``trainer.shard_redundancy=2``) or from its
  group's parity (``trainer.shard_parity=2``), :mod:`robustagg.training.shard_recovery`. Each is
  compared with the same settings unfaulted (``step_ms`` there shows what keeping the copy or the
  parity costs a step); ``rebuild_s`` and ``rebuild_bytes`` are the reconstruction's own time and
  the bytes it read (the copy, or the parity and the group's other shards), ``steps_lost`` the
  steps recomputed.

**Memory** (``memory.csv``, :data:`MEMORY_COLUMNS`; ``memory.enabled``): optimizer-state bytes per
rank against the world size for the model ``memory.target`` and Adam, unsharded, sharded,
sharded with a copy (``k = 2``) and with a parity (``g = 2``): the largest rank's own shard, the
copies it keeps and the parity blocks it holds, measured on real
:class:`~robustagg.training.state_sharding.OptimizerShard` objects after one step.

Every time comes from the run's own records (:func:`timeline`), all ``time.time()`` of one machine.
One row per restore source (``restore_source``: ``disk``, ``live-peer``; ``peer-memory`` is the
place for an in-memory copy on a peer, not built yet).

Read it with the machine's load in mind (``load1``: the 1-minute load average when the row was
measured): on a shared machine every wall-clock figure moves with the other tenants.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import hydra
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from robustagg.checkpoint import read_jsonl
from robustagg.errors import AssumptionError, ConfigError
from robustagg.training.evidence import read_evidence
from robustagg.training.resume import FAULT_LOG

from .bench import machine, write_csv
from .bench_train import build_trainer, compose, overrides

OVERHEAD_COLUMNS = ["model", "d", "n", "every", "saves", "state_mb", "step_ms", "save_ms", "overhead_pct",
                    "measured_pct", "snapshot_ms", "serialise_ms", "write_fsync_ms", "commit_ms", "other_ms",
                    "timed_steps", "load1", "note"]
RECOVERY_COLUMNS = ["case", "repeat", "on_failure", "restore_source", "n", "n_after", "steps", "every", "crash_step",
                    "committed_step", "steps_lost", "detect_s", "recorded_s", "respawn_s", "rebuild_s", "rebuild_bytes",
                    "restore_s", "regroup_s", "back_s", "step_ms", "wall_s", "wall_unfaulted_s", "wall_extra_s", "load1",
                    "note"]
MEMORY_COLUMNS = ["model", "d", "world", "state", "own_bytes", "held_bytes", "total_bytes", "fraction_of_unsharded",
                  "held_bytes_all_ranks"]
#: The pieces of one save timed by :class:`SaveSplit` (ms), in the order they happen.
PIECES = ["snapshot_ms", "serialise_ms", "write_fsync_ms", "commit_ms", "other_ms"]
#: Where a restore's state comes from (the ``restore_source`` column).
SOURCES = ("disk", "live-peer", "live-peer, own: peer-memory", "peer-memory")


def _load1() -> float:
    try:
        return float(os.getloadavg()[0])
    except OSError:  # pragma: no cover - no load average on this platform
        return math.nan


# --- checkpoint overhead --------------------------------------------------------------------------
class SaveSplit:
    """Times the pieces of :meth:`~robustagg.training.Checkpointer.save` by wrapping what it calls.

    While :meth:`timing` is active it replaces, in this process only, ``trainer.state_dict`` (the
    snapshot), ``robustagg.training.resume.save_state`` (serialise + write of each state file),
    ``robustagg.checkpoint.atomic_write_bytes`` (the write + fsync part of it) and
    ``store.commit`` (rank 0's commit), and puts the originals back on exit. Each timed save adds
    one entry per piece of :data:`PIECES` (wall-clock milliseconds); ``other_ms`` is the save's
    total minus the timed pieces (votes, staging folder, lineage and fault-log reads).

    Args:
        clock: seconds (``time.perf_counter``: wall clock, since fsync is I/O, not CPU).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.saves: list[dict[str, float]] = []

    @contextmanager
    def timing(self, trainer: Any, store: Any) -> Iterator[dict[str, float]]:
        """Time one save of ``trainer`` into ``store`` inside the ``with`` block; yields its entry."""
        import robustagg.checkpoint as ck_mod
        import robustagg.training.resume as resume_mod

        clock = self.clock
        acc = {"snapshot": 0.0, "files": 0.0, "file_writes": 0.0, "commit": 0.0}
        depth = {"files": 0}
        orig = (resume_mod.save_state, ck_mod.atomic_write_bytes, store.commit, trainer.state_dict)

        def timed(key: str, fn: Callable[..., Any], nest: Optional[str] = None) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if nest is not None and not depth[nest]:
                    return fn(*args, **kwargs)  # a write outside the state files (manifest, LATEST)
                if key == "files":
                    depth["files"] += 1
                t0 = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[key] += clock() - t0
                    if key == "files":
                        depth["files"] -= 1
            return wrapper

        resume_mod.save_state = timed("files", orig[0])  # type: ignore[assignment]
        ck_mod.atomic_write_bytes = timed("file_writes", orig[1], nest="files")  # type: ignore[assignment]
        store.commit = timed("commit", orig[2])
        trainer.state_dict = timed("snapshot", orig[3])
        entry: dict[str, float] = {}
        t0 = clock()
        try:
            yield entry
        finally:
            total = clock() - t0
            resume_mod.save_state, ck_mod.atomic_write_bytes = orig[0], orig[1]  # type: ignore[assignment]
            del store.commit, trainer.state_dict  # the instance attributes go; the class methods show again
            ms = {k: v * 1e3 for k, v in acc.items()}
            entry.update(snapshot_ms=ms["snapshot"], serialise_ms=ms["files"] - ms["file_writes"],
                         write_fsync_ms=ms["file_writes"], commit_ms=ms["commit"],
                         other_ms=total * 1e3 - ms["snapshot"] - ms["files"] - ms["commit"], save_ms=total * 1e3)
            self.saves.append(entry)


def _state_mb(store: Any) -> float:
    ck, _ = store.latest()
    if ck is None:
        return math.nan
    return sum(int(v["size"]) for v in ck.manifest["files"].values()) / 2**20


def overhead_rows(cfg: DictConfig, out: Path) -> list[dict[str, Any]]:
    """The checkpoint-overhead table for every model and interval of ``cfg.overhead`` (see the module docstring).

    Checkpoints are written under ``out/overhead-checkpoints/`` and removed afterwards.

    Raises:
        ValueError: ``overhead.every`` lacks 0 (the reference without checkpoints), or an interval
            does not divide ``steps × repeats`` (its saves would not be amortised evenly).
    """
    from robustagg.checkpoint import CheckpointStore
    from robustagg.training import Checkpointer, step_record

    o = cfg.overhead
    n = int(o.n)
    f = n // 5 if o.f is None else int(o.f)
    every = overhead_intervals(o)
    root = out / "overhead-checkpoints"
    rows: list[dict[str, Any]] = []
    clock = time.perf_counter
    for name, extra in o.models.items():
        ovr = overrides(n, f, str(o.aggregator), str(o.attack), bool(o.metrics),
                        extra=(*(str(x) for x in extra), *(str(x) for x in o.overrides)))
        base = compose(ovr)
        trainers = {k: build_trainer(base, str(root)) for k in every}
        stores = {k: CheckpointStore(root / f"{name}-every-{k}", keep=2) for k in every if k}
        ckpts = {k: Checkpointer(s, every=k, meta={"run_id": f"bench-{name}-{k}"}) for k, s in stores.items()}
        splits = {k: SaveSplit(clock) for k in ckpts}
        steps: dict[int, list[float]] = {k: [] for k in every}
        for k, tr in trainers.items():  # untimed: first calls, first files
            for _ in range(int(o.warmup)):
                step_record(tr.step(), tr)
            if k:
                ckpts[k].save(tr)
        for _ in range(int(o.repeats)):
            for k, tr in trainers.items():
                for _ in range(int(o.steps)):
                    t0 = clock()
                    step_record(tr.step(), tr)
                    steps[k].append((clock() - t0) * 1e3)
                    if k and ckpts[k].due(tr.step_id):
                        with splits[k].timing(tr, stores[k]):
                            ckpts[k].save(tr)
        d = sum(p.numel() for p in trainers[0].model.parameters())
        ref = statistics.fmean(steps[0])
        for k in every:
            step_ms = statistics.fmean(steps[k])
            saves = splits[k].saves if k else []
            save_total = sum(s["save_ms"] for s in saves)
            row: dict[str, Any] = {"model": str(name), "d": d, "n": n, "every": k, "saves": len(saves),
                                   "step_ms": step_ms, "timed_steps": len(steps[k]), "load1": _load1(),
                                   "note": "checkpointing off (the reference)" if not k else ""}
            if k:
                row.update(state_mb=_state_mb(stores[k]), save_ms=save_total / len(saves),
                           overhead_pct=100.0 * save_total / sum(steps[k]),
                           measured_pct=100.0 * ((sum(steps[k]) + save_total) / len(steps[k]) - ref) / ref,
                           **{p: statistics.fmean(s[p] for s in saves) for p in PIECES})
            rows.append(row)
        del trainers
        shutil.rmtree(root, ignore_errors=True)
    return rows


# --- recovery after a real crash -----------------------------------------------------------------
def _first(records: list[dict[str, Any]], **match: Any) -> Optional[dict[str, Any]]:
    return next((r for r in records if all(r.get(k) == v for k, v in match.items())), None)


def _minus(a: Any, b: Any) -> float:
    return float(a) - float(b) if a is not None and b is not None else math.nan


def timeline(run_dir: Path, ckpt_dir: Optional[Path] = None) -> list[dict[str, Any]]:
    """The recovery rows of a finished run, read from its records (``time.time()`` seconds of one machine).

    Reads the first fired ``crash`` or ``rejoin`` fault (``faults.jsonl``: its ``time`` is just
    before the kill), the survivors' evidence of that attempt (``evidence/attempt-<k>/``), the
    launcher's detection record (``detections.jsonl``), and the lineage (``restore`` record of
    the next attempt: ``time``, ``restore_s``, ``restored_from``, ``steps_replayed``; ``grow``:
    ``time``, ``regroup_s``, ``transfer_s``). Intervals from the kill (``t_kill``):

    - ``detect_s``: to the first survivor's evidence (it noticed: its collective failed, or the
      launcher's stop reached it); ``recorded_s``: to the launcher's detection record (after the
      teardown of the group);
    - ``respawn_s``: from the detection record to the start of the restore (new processes, the
      job's data and model built again); ``restore_s``: the restore itself (disk: choose,
      verify every digest, load, agree; live peer: the broadcast of the replicated state, the
      joiner's SHA-256 check and the parameter/optimizer digest agreement);
    - ``back_s``: to the moment the group can train again (the restore record; for the joiner
      the grow record); ``regroup_s`` (live peer): from the step boundary where the survivors
      admit the joiner to that moment (new epoch, new process group, trainer rebuilt, transfer);
    - ``steps_lost``: completed steps that were recomputed (``steps_replayed``: from the
      committed step + 1 to the last step reached before the kill; ``crash_step`` − 1 −
      ``committed_step`` for a kill at the start of ``crash_step``).

    Returns:
        ``[]`` when no crash fault fired; else one row for the group's restore (``disk``, or the
        restore record's own ``restore_source`` when it names one, e.g. ``peer-memory`` for an
        in-memory copy on a peer) and, after a grow, one ``live-peer`` row (keys: a subset of
        :data:`RECOVERY_COLUMNS`; a missing record gives NaN).
    """
    run_dir = Path(run_dir)
    ck = Path(ckpt_dir) if ckpt_dir is not None else run_dir / "checkpoints"
    fired = [r for r in read_jsonl(ck / FAULT_LOG) if r.get("kind") in ("crash", "rejoin")]
    if not fired:
        return []
    kill = fired[0]
    attempt, t_kill = int(kill.get("attempt", 0)), kill.get("time")
    lost = int(kill.get("rank", -1))
    notice = [e["time"] for e in read_evidence(run_dir / "evidence" / f"attempt-{attempt}")
              if e.get("time") is not None and lost not in (e.get("workers") or [])]
    if not notice:  # no restart followed: the evidence was not archived
        notice = [e["time"] for e in read_evidence(run_dir / "evidence")
                  if e.get("time") is not None and lost not in (e.get("workers") or [])]
    det = _first(read_jsonl(run_dir / "detections.jsonl"), source="failure", attempt=attempt) or {}
    lineage = read_jsonl(ck / "lineage.jsonl")
    rest = _first(lineage, event="restore", restart=attempt + 1) or {}
    replayed = rest.get("steps_replayed") or []
    started = _minus(rest.get("time"), rest.get("restore_s"))
    disk = {"restore_source": str(rest.get("restore_source") or rest.get("source") or "disk"), "crash_step": int(kill["step"]), "committed_step": rest.get("restored_from"),
            "steps_lost": (int(replayed[1]) - int(replayed[0]) + 1) if len(replayed) == 2 else 0 if rest else math.nan,
            "n_after": rest.get("world_size"),
            "detect_s": _minus(min(notice), t_kill) if notice else math.nan,
            "recorded_s": _minus(det.get("time"), t_kill), "respawn_s": _minus(started, det.get("time")),
            "restore_s": rest.get("restore_s", math.nan), "back_s": _minus(rest.get("time"), t_kill)}
    rebuilt = _first(lineage, event="shard_recovery", attempt=attempt)
    if rebuilt is not None:
        if rebuilt.get("fallback"):
            disk["note"] = "shard not rebuilt: " + "; ".join(rebuilt["fallback"])
        elif rebuilt.get("sources"):
            disk.update(restore_source=f"disk + {rebuilt.get('source')}", rebuild_s=rebuilt.get("seconds", math.nan),
                        rebuild_bytes=rebuilt.get("bytes_read", math.nan),
                        note="; ".join(f"slice {k} from {v}" for k, v in (rebuilt.get("sources") or {}).items()))
    rows = [disk]
    grow = _first(lineage, event="grow")
    if grow is not None:
        own = str(((grow.get("sources") or {}).get("own") or {}).get(str(lost), "disk"))
        rows.append({"restore_source": "live-peer" if own == "disk" else f"live-peer, own: {own.split()[0]}", "crash_step": int(kill["step"]), "committed_step": math.nan,
                     "steps_lost": math.nan, "n_after": grow.get("new_n"),
                     "restore_s": grow.get("transfer_s", math.nan), "regroup_s": grow.get("regroup_s", math.nan),
                     "back_s": _minus(grow.get("time"), t_kill),
                     "note": f"admitted after step {grow.get('step')}: "
                             f"{str(grow.get('state_from', 'a live peer')).split(' (')[0]}; own data position and "
                             f"RNG from {own} {(grow.get('own_state_from') or {}).get(str(lost), '')}".rstrip()})
    return rows


def _case_overrides(c: DictConfig, case: str) -> list[str]:
    """``experiments.train`` overrides of one recovery case (``unfaulted``, ``restart``, ``rejoin``)."""
    base = overrides(int(c.n), int(c.f), str(c.aggregator), str(c.attack), False, mode="processes",
                     extra=(f"trainer.steps={int(c.steps)}", f"trainer.checkpoint.every={int(c.every)}",
                            "trainer.param_check_every=0", *(str(x) for x in c.overrides)))
    rank, step = int(c.rank), int(c.step)
    if case == "unfaulted":
        return base
    if case == "unfaulted-shrink":  # the same machinery as rejoin (membership store, fenced commits), no fault
        return [*base, "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.max_restarts=1"]
    if case == "restart":
        return [*base, "faults=[crash]", f"faults.crash.rank={rank}", f"faults.crash.step={step}",
                "faults.crash.where=before_step", "trainer.on_failure=restart", "trainer.max_restarts=1"]
    if case == "rejoin":
        return [*base, "faults=[rejoin]", f"faults.rejoin.rank={rank}", f"faults.rejoin.step={step}",
                f"faults.rejoin.seconds={float(c.rejoin_after_s)}", "faults.rejoin.join_step=0", "trainer.on_failure=shrink",
                "trainer.rejoin=true", "trainer.max_restarts=1"]
    if case == "rejoin_peer_memory":  # the joiner's own state from a survivor's memory: its disk copy is pruned
        join = step + int(c.every)  # admitted after the survivors' next commit, which (keep=1) prunes the old one
        return [*base, "faults=[rejoin]", f"faults.rejoin.rank={rank}", f"faults.rejoin.step={step}",
                f"faults.rejoin.seconds={float(c.rejoin_after_s)}", f"faults.rejoin.join_step={join}",
                "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.peer_copy=true",
                "trainer.checkpoint.keep=1", "trainer.max_restarts=1"]
    sharded = ["trainer.reduction=sharded", "trainer.state_sharding=optimizer", "optimizer=adam",
               "trainer.on_failure=shrink", "trainer.max_restarts=1"]
    second = {"checkpoint": [], "copy": ["trainer.shard_redundancy=2"], "parity": ["trainer.shard_parity=2"]}
    for name, more in second.items():
        if case == f"unfaulted-shard_{name}":
            return [*base, *sharded, *more]
        if case == f"shard_{name}":
            return [*base, *sharded, *more, "faults=[crash]", f"faults.crash.rank={rank}", f"faults.crash.step={step}",
                    "faults.crash.where=before_step"]
    raise ValueError(f"crash.cases: unknown case {case!r}; use restart, rejoin, rejoin_peer_memory, shard_checkpoint, "
                     "shard_copy and/or shard_parity.")


def _run(c: DictConfig, case: str, run_dir: Path) -> float:
    """Run one case in this process (its workers are real processes) into ``run_dir``; wall seconds.

    Raises:
        FileExistsError: ``run_dir`` exists (a second run there would resume the first one's
            checkpoints instead of training): choose a fresh ``hydra.run.dir``.
    """
    from .train import train

    if run_dir.exists():
        raise FileExistsError(f"{run_dir} exists: a run there would resume its checkpoints instead of training; "
                              "choose a fresh hydra.run.dir.")
    cfg = compose(_case_overrides(c, case))
    t0 = time.perf_counter()
    train(cfg, out_dir=run_dir, quiet=True)
    return time.perf_counter() - t0


def _step_ms(run_dir: Path) -> float:
    secs = [float(r["time/step_s"]) for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return statistics.median(secs) * 1e3 if secs else math.nan


#: The unfaulted run each case is compared with: the same settings without the fault.
_REFERENCE = {"restart": "unfaulted", "rejoin": "unfaulted-shrink", "rejoin_peer_memory": "unfaulted-shrink",
              "shard_checkpoint": "unfaulted-shard_checkpoint", "shard_copy": "unfaulted-shard_copy",
              "shard_parity": "unfaulted-shard_parity"}
_HOW = {"unfaulted": "restart", "restart": "restart", "unfaulted-shrink": "shrink + rejoin",
        "rejoin": "shrink + rejoin", "rejoin_peer_memory": "shrink + rejoin + peer_copy",
        **{f"{pre}shard_{name}": f"shrink, sharded state{how}" for pre in ("", "unfaulted-")
           for name, how in (("checkpoint", ""), ("copy", ", k=2 copies"), ("parity", ", g=2 parity"))}}


def recovery_rows(cfg: DictConfig, out: Path) -> list[dict[str, Any]]:
    """``crash.repeats`` rounds of the unfaulted run and every case of ``crash.cases`` (in turn, so
    a change of load hits all alike), as rows of :data:`RECOVERY_COLUMNS` (``repeat``: the round).

    With ``crash.warmup`` an untimed unfaulted run goes first (the first run in a process pays
    one-off costs: imports in the workers, the kernels' first calls). Each faulted row's
    ``wall_unfaulted_s`` is its reference in the same round: ``unfaulted`` (the same settings,
    no fault) for ``restart``, ``unfaulted-shrink`` (also ``on_failure=shrink``, ``rejoin=true``:
    the membership store and the fenced commits cost time in every step) for ``rejoin``.

    Raises:
        ValueError: an unknown case, or ``crash.step`` does not leave a committed checkpoint
            before the kill (``crash.step - 1 < crash.every``: nothing to restore but step 0).
        FileExistsError: a run folder exists already (see :func:`_run`).
        WorkerFailedError, RobustAggError: a run failed (the recovery under test did not work).
    """
    c = cfg.crash
    if int(c.step) - 1 < int(c.every):
        raise ValueError(f"crash.step={int(c.step)} kills before the first checkpoint (crash.every={int(c.every)}); "
                         "choose crash.step > crash.every.")
    for case in c.cases:
        _case_overrides(c, str(case))  # unknown cases fail before any run
    common = {"n": int(c.n), "steps": int(c.steps), "every": int(c.every)}
    refs = {str(case): _REFERENCE[str(case)] for case in c.cases}
    if c.warmup:
        _run(c, "unfaulted", out / "run-warmup")
    rows: list[dict[str, Any]] = []
    for i in range(int(c.repeats)):
        ref_wall: dict[str, float] = {}
        for ref in dict.fromkeys(refs.values()):
            ref_dir = out / f"run-{ref}-{i}"
            ref_wall[ref] = _run(c, ref, ref_dir)
            rows.append({**common, "case": ref, "repeat": i, "on_failure": _HOW[ref], "restore_source": "-",
                         "n_after": int(c.n), "step_ms": _step_ms(ref_dir), "wall_s": ref_wall[ref],
                         "load1": _load1(), "note": "no fault: the reference"})
        for case in c.cases:
            run_dir = out / f"run-{case}-{i}"
            wall = _run(c, str(case), run_dir)
            ref = refs[str(case)]
            for r in timeline(run_dir):
                rows.append({**common, "case": str(case), "repeat": i, "on_failure": _HOW[str(case)],
                             "step_ms": _step_ms(run_dir), "wall_s": wall, "wall_unfaulted_s": ref_wall[ref],
                             "wall_extra_s": wall - ref_wall[ref], "load1": _load1(), **r})
    return rows


def medians(rec: pd.DataFrame) -> pd.DataFrame:
    """One row per ``(case, restore_source)`` of the recovery table: the median of every numeric
    column over the repeats (``repeat`` becomes the number of rounds); text columns from the first."""
    if not len(rec):
        return rec
    out = []
    for _, g in rec.groupby(["case", "restore_source"], sort=False):
        row = {c: (g[c].median() if pd.api.types.is_numeric_dtype(g[c]) else g[c].iloc[0]) for c in rec.columns}
        row["repeat"] = len(g)
        out.append(row)
    return pd.DataFrame(out).reindex(columns=rec.columns)


def memory_rows(cfg: DictConfig) -> list[dict[str, Any]]:
    """Optimizer-state bytes per rank against the world size (:data:`MEMORY_COLUMNS`).

    The model ``memory.target`` (a class path, built with ``memory.kwargs``) with Adam, one step of a random aggregate on
    real :class:`~robustagg.training.state_sharding.OptimizerShard` objects (their state only:
    no process group is needed for it). Per world size and state layout, the rank that holds the
    most: ``own_bytes`` (its shard; unsharded: the whole state), ``held_bytes`` (the copies of
    the ``k - 1`` preceding slices, or the parity blocks it keeps: one block per group it holds,
    as wide as the widest slice's state bytes), ``fraction_of_unsharded`` of the total;
    ``held_bytes_all_ranks``: what every rank together keeps beyond its own shard (a copy costs
    every rank ``k - 1`` slices; a parity costs one slice per group, on its holder alone).
    """
    from hydra.utils import instantiate

    from robustagg.distributed.sharded import shard_bounds
    from robustagg.training.shard_protection import held_slices, parity_groups, parity_holder
    from robustagg.training.state_sharding import OptimizerShard, optimizer_state_bytes, shard_bytes

    m = cfg.memory
    torch.manual_seed(0)
    model = instantiate({"_target_": str(m.target), **OmegaConf.to_container(m.kwargs)})
    params = [p for p in model.parameters() if p.requires_grad]
    d = sum(p.numel() for p in params)
    agg = torch.randn(d, generator=torch.Generator().manual_seed(0))
    whole = torch.optim.Adam(params, lr=1e-3)
    for p, g in zip(params, torch.split(agg, [p.numel() for p in params])):
        p.grad = g.view_as(p).clone()
    whole.step()
    unsharded = optimizer_state_bytes(whole)
    whole.state.clear()
    name = str(m.name)
    rows = [{"model": name, "d": d, "world": 1, "state": "unsharded", "own_bytes": unsharded, "held_bytes": 0,
             "total_bytes": unsharded, "fraction_of_unsharded": 1.0, "held_bytes_all_ranks": 0}]
    for world in (int(w) for w in m.worlds):
        bounds = shard_bounds(d, world)
        shards = [OptimizerShard(whole, params, bounds, r) for r in range(world)]
        for sh in shards:
            sh.local_step(agg)
        own = [sh.state_bytes() for sh in shards]
        width = max(shard_bytes(sh.export(copy=False)).numel() for sh in shards)
        layouts = {"sharded": [0] * world,
                   "sharded + copy (k=2)": [sum(own[s] for s in held_slices(r, world, 2)) for r in range(world)]}
        for g in sorted({2, world // 2}):
            groups = parity_groups(world, g)
            if g >= 2 and len(groups) >= 2:
                layouts[f"sharded + parity (g={g})"] = [width * sum(1 for j in range(len(groups))
                                                                    if parity_holder(j, world, g) == r)
                                                        for r in range(world)]
        for label, held in layouts.items():
            r = max(range(world), key=lambda i: own[i] + held[i])
            rows.append({"model": name, "d": d, "world": world, "state": label, "own_bytes": own[r],
                         "held_bytes": held[r], "total_bytes": own[r] + held[r],
                         "fraction_of_unsharded": (own[r] + held[r]) / unsharded, "held_bytes_all_ranks": sum(held)})
    return rows


def shard_tables(folder: Path) -> tuple[str, str]:
    """The two Markdown tables ``docs/state-sharding.md`` quotes, from a run's ``recovery_median.csv``
    and ``memory.csv`` in ``folder`` (the sharded-state cases and the memory table)."""
    med = pd.read_csv(Path(folder) / "recovery_median.csv")
    med = med[med["case"].astype(str).str.startswith("shard_")]
    lines = ["| case | state from | steps recomputed | detect s | respawn s | rebuild s | bytes read | restore s "
             "| back s (kill to training) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in med.to_dict("records"):
        lines.append(f"| {r['case']} | {r['restore_source']} (step {_fmt(r['committed_step'])}) | {_fmt(r['steps_lost'])} "
                     f"| {r['detect_s']:.3f} | {r['respawn_s']:.3f} | "
                     f"{'—' if pd.isna(r['rebuild_s']) else format(r['rebuild_s'], '.3f')} | "
                     f"{'—' if pd.isna(r['rebuild_bytes']) else format(int(r['rebuild_bytes']), ',')} | "
                     f"{r['restore_s']:.3f} | {r['back_s']:.3f} |")
    mem = pd.read_csv(Path(folder) / "memory.csv")
    rows = ["| world | state | own bytes | held bytes | total | of unsharded | held, all ranks |",
            "|---|---|---|---|---|---|---|"]
    for r in mem.to_dict("records"):
        rows.append(f"| {r['world']} | {r['state']} | {int(r['own_bytes']):,} | {int(r['held_bytes']):,} | "
                    f"{int(r['total_bytes']):,} | {r['fraction_of_unsharded']:.3f} | {int(r['held_bytes_all_ranks']):,} |")
    return "\n".join(lines), "\n".join(rows)


# --- the app ------------------------------------------------------------------------------------------
def overhead_intervals(o: DictConfig) -> list[int]:
    """The checkpoint intervals of ``overhead.every`` (steps; 0 = off).

    Raises:
        ValueError: 0 is missing (the reference step time without checkpoints), or an interval
            does not divide ``steps x repeats`` (its saves would not be amortised evenly).
    """
    every = [int(k) for k in o.every]
    total = int(o.steps) * int(o.repeats)
    if 0 not in every:
        raise ValueError(f"overhead.every={every} needs 0 (checkpointing off: the reference step time); add it.")
    uneven = [k for k in every if k and total % k]
    if uneven:
        raise ValueError(f"overhead.every: {uneven} do not divide overhead.steps x overhead.repeats = {total}; "
                         "choose steps so that every interval divides it.")
    return every


def check_settings(cfg: DictConfig) -> None:
    """Refuse every setting that would fail part-way, before any run starts (and writes a folder).

    Raises:
        ValueError: an overhead interval set without 0 or not dividing its steps, an unknown crash
            case, or a kill before the first checkpoint.
        ConfigError: a case's run that ``experiments.train`` would refuse (a worker id or step out
            of range, a rule's requirement), from :func:`experiments.wiring.validate`.
    """
    import tempfile

    from .wiring import validate

    if cfg.overhead.enabled:
        overhead_intervals(cfg.overhead)
    if cfg.crash.enabled:
        c = cfg.crash
        if int(c.step) - 1 < int(c.every):
            raise ValueError(f"crash.step={int(c.step)} kills before the first checkpoint (crash.every="
                             f"{int(c.every)}); choose crash.step > crash.every.")
        with tempfile.TemporaryDirectory() as tmp:
            for case in ["unfaulted", *dict.fromkeys(_REFERENCE[str(x)] for x in c.cases if str(x) in _REFERENCE),
                         *(str(x) for x in c.cases)]:
                validate(compose(_case_overrides(c, case)), out_dir=str(Path(tmp) / case))


def run_bench(cfg: DictConfig, out: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Run ``cfg``: ``(overhead table (OVERHEAD_COLUMNS), recovery table (RECOVERY_COLUMNS), memory
    table (MEMORY_COLUMNS))``."""
    import warnings

    warnings.simplefilter("ignore")  # the mean's "f >= 1 declared" advisory and friends
    if cfg.quick:
        quick = cfg.quick_settings
        cfg = OmegaConf.merge(cfg, quick)  # type: ignore[assignment]
        if "models" in quick.get("overhead", {}):
            cfg.overhead.models = quick.overhead.models  # replaced, not merged into the full list
    torch.set_num_threads(int(cfg.threads))
    check_settings(cfg)
    over = overhead_rows(cfg, out) if cfg.overhead.enabled else []
    rec = recovery_rows(cfg, out) if cfg.crash.enabled else []
    mem = memory_rows(cfg) if cfg.memory.enabled else []
    return (pd.DataFrame(over).reindex(columns=OVERHEAD_COLUMNS), pd.DataFrame(rec).reindex(columns=RECOVERY_COLUMNS),
            pd.DataFrame(mem).reindex(columns=MEMORY_COLUMNS))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))  # steps, counts, n (pandas turns them into floats next to NaN)
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _print(over: pd.DataFrame, rec: pd.DataFrame, mem: Optional[pd.DataFrame] = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=240)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for title, table, caption in (
            ("checkpoint overhead per step", over,
             "overhead_pct: save time amortised over the interval / step time (CheckFreq, FAST 2021: <= 3.5 %); "
             "measured_pct: (step+save at k - step at k=0) / step at k=0"),
            ("recovery after a SIGKILL (median over `repeat` rounds)", rec,
             "seconds from the kill: detect (first survivor's evidence), recorded (launcher), back (can train again); "
             "respawn: detection -> restore start; restore: disk verify+load or live-peer transfer+verify; "
             "rebuild: a lost optimizer-state shard from a copy or a parity"),
            ("optimizer-state bytes per rank (the largest rank)", mem if mem is not None else pd.DataFrame(),
             "own: its shard (unsharded: the whole state); held: copies of other slices or parity blocks")):
        if not len(table):
            continue
        out = Table(title=f"{title} ({machine()}; load average {load})", caption=caption)
        cols = [c for c in table.columns if c != "note" and not table[c].isna().all()]
        for col in cols:
            out.add_column(col, justify="left" if col in ("model", "case", "on_failure", "restore_source") else "right")
        for r in table.to_dict("records"):
            out.add_row(*[_fmt(r[c]) for c in cols])
        console.print(out)
        key = ("model", "every") if "model" in table.columns and table["model"].notna().any() else ("case", "restore_source")
        for r in table.to_dict("records"):  # the notes under the table: a column of them would not fit
            if isinstance(r.get("note"), str) and r["note"]:
                console.print(f"  {' / '.join(_fmt(r[k]) for k in key)}: {r['note']}")


@hydra.main(config_path="../conf/bench_recovery", config_name="bench_recovery", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run, print the overhead table and the recovery medians, write the three CSVs."""
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[assignment]
    try:
        over, rec, mem = run_bench(cfg, out_dir)
    except (ValueError, ConfigError, AssumptionError) as exc:  # a bad setting: one line, before any run (check_settings)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    med = medians(rec)
    _print(over, med, mem)
    write_csv(over, out_dir / str(cfg.overhead_csv))
    write_csv(rec, out_dir / str(cfg.recovery_csv))
    write_csv(med, out_dir / str(cfg.recovery_median_csv))
    write_csv(mem, out_dir / str(cfg.memory_csv))
    print(f"wrote {out_dir / str(cfg.overhead_csv)}, {out_dir / str(cfg.recovery_csv)} (every round), "
          f"{out_dir / str(cfg.recovery_median_csv)} (medians, as printed) and {out_dir / str(cfg.memory_csv)}")


if __name__ == "__main__":
    main()
