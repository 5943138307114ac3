"""Launch and supervise a :class:`~robustagg.launch.Job`: one call for every mode.

:func:`launch` is the library's run lifecycle, the same for ``python -m experiments.train`` and for
a researcher's own script:

1. **Before any process starts**: the settings and the rule's requirement are checked; the run
   directory is locked (:class:`~robustagg.launch.RunLock`: a second launch on it is refused);
   with ``resume=auto`` the newest committed checkpoint is found and verified, and its experiment
   fingerprint compared with the job's (:func:`~robustagg.launch.identity.check_resume`: a mixed
   experiment is refused unless ``resume_changes="allow"``; a folder whose checkpoints all fail
   verification is refused, each reason written to the lineage); with ``resume=never`` on a folder
   that holds checkpoints the run starts over in a *new* folder (``<run_dir>-2``, ...), never on
   top of the old files.
2. **Run**: ``simulated`` hosts every worker here; ``processes`` spawns n workers (the library's
   launcher, with restarts and elastic shrink), or joins the group torchrun started (torchrun
   restarts it; rank 0 chooses the run directory and shares it with every rank).
3. **After a failure**: the survivors' evidence becomes a detection record; with restarts left,
   the group restarts from the newest committed checkpoint (same n, or the survivors under
   ``on_failure="shrink"`` if the rule's requirement still holds for them).

Kill, then run the same command again: that is the resume path. The run directory must be stable
(e.g. ``run_name=...`` in the Hydra app) for the second command to find the first one's checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..checkpoint import CheckpointStore, read_jsonl
from ..distributed import (EnvRank, LocalComm, ProcessGroupComm, WorkerFailedError, destroy_group, free_port,
                           from_environment, init_group, raise_on_sigterm, spawn)
from ..errors import CheckpointError, ConfigError, QuorumLostError, StorageError
from ..functional.gram import needs_warm_up, warm_up
from ..training import read_evidence
from .identity import FRESH_START, check_resume, check_resume_from, recorded_value, resume_log_level
from .job import Job, RunSettings, shrink_job
from .lock import RunLock
from .quorum import Membership, next_epoch
from .records import Attempt, last_step_reached, record_failure
from .worker import device_for, run_joiner, run_worker

__all__ = ["launch", "prepare", "read_summary", "run_simulated", "run_spawned", "run_torchrun", "spawned_entry"]

log = logging.getLogger("robustagg.launch")


#: Worker errors a restart cannot cure: the group is not restarted after them.
_NOT_RESTARTED = ("NothingToRestoreError", "StorageError")


def _root_message(exc: WorkerFailedError) -> str:
    """The message of the worker exception that caused ``exc`` (its first line)."""
    for rec in exc.failures:
        if int(rec.get("rank", -1)) == exc.rank and rec.get("type") == exc.error_type:
            return str(rec.get("message", "")).splitlines()[0] if rec.get("message") else str(exc)
    return str(exc).splitlines()[0]


def _has_checkpoints(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_dir() and p.name.startswith("step-") and "." not in p.name
                                   for p in folder.iterdir())


def _fresh_sibling(run_dir: Path) -> Path:
    k = 2
    while (cand := run_dir.with_name(f"{run_dir.name}-{k}")).exists():
        k += 1
    return cand


def prepare(job: Job, *, restarted: bool = False) -> tuple[Job, Attempt, str]:
    """Step 1 of :func:`launch` without the lock: settle the run directory and what to resume.

    Args:
        job: the job. restarted: this process is a torchrun restart (its own checkpoints are
            expected; ``resume=never`` then means "this run's", not "start over").

    Returns:
        ``(job, attempt, message)``: the job (its run directory may be a fresh one, its run id
        set), the first :class:`Attempt`, and one line saying what was found.

    Raises:
        ConfigError, AssumptionError: bad settings, the rule's requirement, a mixed experiment, a
            folder whose committed checkpoints all fail verification, an explicit ``resume``
            folder without a manifest.
    """
    s = job.settings
    s.check()
    if s.mode == "processes" and job.hosts() is not None and s.on_failure == "shrink":
        raise ConfigError(f"trainer.on_failure=shrink needs one process per worker; trainer.processes="
                          f"{s.processes} puts several of the n={job.n} workers in one process. Use "
                          "trainer.on_failure=restart or trainer.processes=0.")
    job.violations = list(dict.fromkeys(job.violations + job.check_rule()))
    job.run_id = job.run_id or uuid.uuid4().hex[:12]
    run_dir = Path(job.run_dir)
    ckpt = Path(job.ckpt_dir)
    _batched_from_checkpoint(job, ckpt)
    attempt = Attempt(number=0, resume=s.resume, fallback=s.resume if s.resume not in ("auto", "never") else "")
    if s.resume == "never" and not restarted and _has_checkpoints(ckpt):
        if s.ckpt_dir and not ckpt.resolve().is_relative_to(run_dir.resolve()):
            raise ConfigError(f"trainer.resume=never but {ckpt} already holds committed checkpoints of another run; "
                              f"continue it with trainer.resume=auto, or choose another trainer.checkpoint.dir.")
        fresh = _fresh_sibling(run_dir)
        message = (f"resume=never: {run_dir} holds checkpoints of an earlier run (kept); starting over in {fresh}")
        if s.ckpt_dir:  # a checkpoint folder inside the run directory moves with it
            s.ckpt_dir = str(fresh / ckpt.resolve().relative_to(run_dir.resolve()))
        job.run_dir = str(fresh)
        return job, attempt, message
    if s.resume not in ("auto", "never"):
        if not (Path(s.resume) / "manifest.json").is_file():
            raise ConfigError(f"trainer.resume={s.resume!r} is not a committed checkpoint folder (no manifest.json); "
                              "use auto, never, or a folder such as <dir>/step-00000040.")
        found = check_resume_from(s.resume, job.fingerprint, resume_changes=s.resume_changes, lineage=ckpt)
        if found.changes:
            attempt.changes = {k: [a, b] for k, (a, b) in found.changes.items()}
        return job, attempt, found.message + " (every rank verifies it again before loading)"
    if s.resume == "never":
        return job, attempt, f"resume=never: {FRESH_START}"
    found = check_resume(ckpt, job.fingerprint, resume_changes=s.resume_changes)
    if found.changes:
        attempt.changes = {k: [a, b] for k, (a, b) in found.changes.items()}
    if found.checkpoint is not None:
        job = committed_membership(job, ckpt / found.checkpoint)
    return job, attempt, found.message


def _batched_from_checkpoint(job: Job, ckpt: Path) -> None:
    """``settings.batched_gradients="auto"`` on a resume: the resumed checkpoint's recorded value
    (:func:`~robustagg.launch.identity.recorded_value`; an old checkpoint without the key: ``False``)
    is what ``auto`` keeps. ``False`` (the loop, always valid) is settled here, before the identity
    check, so a run written with the loop continues with it; ``True`` is left to every process's
    decision on the built model (:func:`~robustagg.training.batched.resolve_batched` keeps it when
    the checks still pass). A fingerprint that holds ``"auto"`` for the key takes the recorded value.
    A fresh run, or a value set by hand, is left alone."""
    from ..training.batched import KEY, BatchedDecision, parse_batched

    s = job.settings
    if parse_batched(s.batched_gradients, key=s.key("batched_gradients")) != "auto":
        return
    recorded = recorded_value(ckpt, KEY, resume=s.resume)
    if not isinstance(recorded, bool):
        return
    if not isinstance(job.fingerprint.get(KEY, False), bool):
        job.fingerprint[KEY] = recorded
    if recorded is False:
        s.batched_gradients = False
        decision = BatchedDecision(False, "auto", "resuming a checkpoint written with the per-worker loop")
        job.meta["batched_gradients_reason"] = decision.describe()
        log.info("%s", decision.line())


def committed_membership(job: Job, checkpoint: Path) -> Job:
    """``job`` with the membership ``checkpoint`` committed: the lineage's shrinks replayed in order.

    A run that shrank (``on_failure="shrink"``) and was then stopped resumes, under the same
    command, with the workers its newest checkpoint holds, not the configured n: the membership is
    a committed fact. Each ``shrink`` record of ``lineage.jsonl`` is applied with
    :func:`~robustagg.launch.job.shrink_job` (the same data redistribution, roles and
    requirement check as at the time) until the membership equals the checkpoint's.

    Raises:
        ConfigError: the checkpoint's workers cannot be reached by the recorded shrinks (a folder
            of another run, or a lineage that was edited).
        AssumptionError: the rule's requirement fails for the committed membership (strict rules).
    """
    try:
        manifest = CheckpointStore(checkpoint.parent).read_manifest(checkpoint)
        members = [int(w) for w in manifest["identities"]]
    except (CheckpointError, ValueError, KeyError, TypeError):
        return job  # no membership recorded (older checkpoints): the configured one
    if members == list(job.identities):
        return job
    for rec in CheckpointStore(checkpoint.parent).lineage():
        if rec.get("event") != "shrink" or list(job.identities) == members:
            continue
        lost = [int(w) for w in rec.get("lost_workers", []) if int(w) in job.identities]
        if lost:
            job, _ = shrink_job(job, lost, reason=f"resumed: the membership committed in {checkpoint.name}")
    if list(job.identities) != members:
        raise ConfigError(f"{checkpoint} holds workers {members} but its lineage's shrinks lead from the configured "
                          f"workers to {list(job.identities)}; resume an explicit folder of this run "
                          "(trainer.resume=PATH) or start over (trainer.resume=never).")
    return job


def _print_cross_check(job: Job) -> None:
    """Log the aggregate cross-check's requirement when one is configured (it is checked in :class:`Job`)."""
    s = job.settings
    if not (int(s.aggregator_replicas) > 1 or s.on_aggregate_mismatch == "vote" or int(s.lying_aggregators) > 0):
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Job already warned and recorded a broken requirement
        block = job.aggregator_requirement()
    log.info("aggregate cross-check: %d replica(s) of every slice, %s on a mismatch, %s a named rank; requirement "
             "%s with f_a = %d: %s", block["replicas"], block["on_aggregate_mismatch"], block["on_lying_aggregator"],
             block["requirement"], block["lying_aggregators"], "holds" if block["holds"] else "BROKEN")


def launch(job: Job, *, on_ready: Optional[Callable[[Job], None]] = None, quiet: bool = False) -> dict[str, Any]:
    """Run ``job`` to the end (see the module docstring) and return rank 0's summary.

    Args:
        job: the :class:`~robustagg.launch.Job`.
        on_ready: called with the settled job (final run directory, lock held) before any worker
            starts, in the launching process (under torchrun: rank 0): write config files there.
        quiet: do not print what resume found.

    Returns:
        the summary (also in ``<run_dir>/summary.json``); ``{}`` on torchrun ranks other than 0.

    Raises:
        ConfigError, AssumptionError: before any process starts (see :func:`prepare`); also a run
            directory locked by another launch (:class:`~robustagg.launch.RunLockedError`).
        WorkerFailedError: a worker failed and no restart was left; the whole group was stopped.
        Interrupted: SIGTERM or SIGINT asked the launcher to stop: every worker stopped after the
            same step, took a final committed checkpoint (when checkpointing is on) and exited;
            never restarted. Its message says "interrupted at step N; run the same command to
            resume", and ``exit_code`` is 143 (SIGTERM) or 130 (SIGINT).
        RobustAggError: in simulated mode, what the step raised.
    """
    job.settings.check()  # a bad value is refused before any lock or folder is made
    _print_cross_check(job)
    env = from_environment()
    if job.settings.mode == "processes" and env is not None:
        return run_torchrun(job, env, on_ready=on_ready, quiet=quiet) or {}
    what = " ".join(sys.argv)[:300]
    with run_locks(job, what):  # first: a second launch must not even read the folders
        job, attempt, message = prepare(job)
        with run_locks(job, what):  # the same locks, or the fresh folder's (resume=never)
            return _run_locked(job, attempt, message, on_ready=on_ready, quiet=quiet)


@contextlib.contextmanager
def run_locks(job: Job, what: str) -> Iterator[list[RunLock]]:
    """Hold the locks of ``job``'s run directory and of its checkpoint folder (the same lock when
    the folder is the run directory); a checkpoint folder shared by two run directories is
    therefore used by one launch at a time.

    Raises:
        RunLockedError: either folder is in use by another launch (the message names which).
    """
    with contextlib.ExitStack() as stack:
        locks = [stack.enter_context(RunLock(job.run_dir, what=what)),
                 stack.enter_context(RunLock(job.ckpt_dir, what=what, label="checkpoint folder"))]
        yield locks


def _run_locked(job: Job, attempt: Attempt, message: str, *, on_ready: Optional[Callable[[Job], None]],
                quiet: bool) -> dict[str, Any]:
    if message and not quiet:
        log.log(resume_log_level(message), "%s", message)
    if on_ready is not None:
        on_ready(job)
    if job.settings.mode == "simulated":
        return run_simulated(job, attempt)
    return run_spawned(job, attempt)


def run_simulated(job: Job, attempt: Optional[Attempt] = None) -> dict[str, Any]:
    """All n workers in this process (no process group)."""
    device = device_for(job, 0)
    result = run_worker(job, LocalComm(job.n, device=device), device, attempt)
    assert result is not None
    return result


def spawned_entry(rank: int, job: Job, init_method: str, attempt: Optional[Attempt] = None) -> None:
    """Entry point of a spawned worker: join the group, train, leave the group."""
    s = job.settings
    torch.set_num_threads(int(s.threads))
    timeout = float(s.collective_timeout_s)
    if attempt is not None and rank >= job.processes():  # a replacement for a lost worker (trainer.rejoin)
        try:
            run_joiner(job, device_for(job, rank), attempt, attempt.joiners[rank - job.processes()])
        finally:
            destroy_group()
        return
    init_group(backend=s.backend, rank=rank, world_size=job.processes(), timeout=timedelta(seconds=timeout),
               init_method=init_method)
    try:
        device = device_for(job, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        number = 0 if attempt is None else attempt.number
        comm = ProcessGroupComm(device=device, timeout_s=timeout, group_id=f"{job.run_id}/attempt-{number}",
                                hosts=job.hosts())
        run_worker(job, comm, device, attempt)
    finally:
        destroy_group()


def run_spawned(job: Job, attempt: Optional[Attempt] = None) -> dict[str, Any]:
    """Start n worker processes on this machine, supervise them, and return rank 0's summary.

    After a failure the supervisor appends a detection record built from the survivors' evidence
    to ``detections.jsonl``; if restarts are left (``max_restarts``) it archives the evidence to
    ``evidence/attempt-<k>/`` and starts the group again, which restores the newest committed
    checkpoint. With ``on_failure="shrink"`` and workers lost, the new group has only the
    survivors, if the rule's requirement still holds for them (:func:`shrink_job`).

    Raises:
        WorkerFailedError: a worker failed and no restart is left; the group was stopped.
        AssumptionError: ``on_failure="shrink"`` would break the rule's requirement.
    """
    s = job.settings
    addr = str(s.master_addr)
    method = s.start_method
    if method == "auto":
        method = "fork" if sys.platform.startswith("linux") and s.device == "cpu" else "spawn"
    attempt = attempt or Attempt(resume=s.resume)
    explicit = s.resume if s.resume not in ("auto", "never") else ""
    out = Path(job.run_dir)
    # skipped only for a Gram-free rule without metrics (their shares use a compiled kernel too); a
    # Gram-using attack: each worker warms up
    if job.rule is None or needs_warm_up(job.rule) or s.metrics:
        warm_up()  # compile once here (forked workers inherit it, spawned ones load Numba's cache)
    members = _membership_store(job, addr, attempt)  # on_failure=shrink: epochs in a store, fenced commits
    if _protected(job):  # rescue files of an earlier launch (its attempts were numbered from 0 too) are stale
        shutil.rmtree(Path(job.ckpt_dir) / "rescue", ignore_errors=True)
    while True:
        port = int(s.port) or free_port(addr)
        try:
            spawn(spawned_entry, job.processes() + len(attempt.joiners), args=(job, f"tcp://{addr}:{port}", attempt),
                  start_method=method, preload=("torch", "torch._dynamo", "robustagg.launch.supervisor"),
                  grace_seconds=2.0 if members is None else _QUORUM_GRACE_S,
                  members=job.processes(),  # the joiners (after them) vote on a stop only once admitted
                  on_failure=_rescue_request(job, attempt))
            break
        except WorkerFailedError as exc:
            hosts = job.hosts() or tuple(range(job.n))
            lost = [job.identities[w] for w in range(job.n) if hosts[w] in exc.lost]
            # a replacement (after the members' processes) that died is gone too, though it was not a member yet
            gone = [int(attempt.joiners[i - job.processes()]["worker"]) for i in exc.lost if i >= job.processes()]
            if exc.error_type == "LyingAggregatorError":  # on_lying_aggregator=exclude: the named ranks leave
                lost = sorted(set(lost) | set(_named_liars(job, out, attempt.number)))
            last = last_step_reached(out)
            more = attempt.number < int(s.max_restarts) and exc.error_type not in _NOT_RESTARTED
            try:
                det = record_failure(out, attempt.number, lost=sorted(lost + gone), message=str(exc), archive=more)
            except StorageError:
                if exc.error_type != "StorageError":
                    raise
                det = {}  # the disk is full or read-only: the worker's message names the file it could not write
            if not more:
                if exc.error_type == "StorageError":  # the worker's one line (path and cause), not a traceback
                    raise StorageError(_root_message(exc)) from None
                if attempt.number:
                    raise WorkerFailedError(f"after {attempt.number} restart(s): {exc}", rank=exc.rank,
                                            error_type=exc.error_type, failures=exc.failures, lost=exc.lost,
                                            terminated=exc.terminated, exitcodes=exc.exitcodes, killed=exc.killed,
                                            states=exc.states, heartbeats=exc.heartbeats, stacks=exc.stacks) from None
                raise
            reason = (f"{det['kind']} detected at step {det['step']}: " if det.get("step") is not None
                      else f"{det['kind']}: ") + str(exc).splitlines()[0][:300]
            log.warning("restart %d/%d after %s", attempt.number + 1, int(s.max_restarts), reason)
            shrink = None
            change: Optional[dict[str, Any]] = None
            if members is not None and attempt.membership is not None:
                lost, change = _next_membership(job, members, attempt.membership, exc, lost, det)
            joiners: list[dict[str, Any]] = []
            if s.on_failure == "shrink" and lost:
                if s.rejoin:
                    joiners = [{"worker": int(w), "byzantine": int(w) in job.byzantine_ids,
                                **_rejoin_timing(job, int(w))} for w in lost]
                before = job
                try:
                    job, shrink = shrink_job(job, lost, reason=reason)
                except Exception as refused:
                    CheckpointStore(Path(job.ckpt_dir)).append_lineage(
                        {"event": "shrink_refused", "old_n": job.n, "lost_workers": lost, "reason": str(refused)})
                    raise
                if shrink is not None and _protected(before):
                    shrink["state_from"] = _rebuild_lost_shards(before, attempt, lost, last)
                if shrink is not None and change is not None:
                    shrink["membership"] = change
            attempt = Attempt(number=attempt.number + 1, reason=reason, resume="auto", fallback=explicit,
                              last_step=last, shrink=shrink, joiners=joiners,
                              membership=None if change is None else dict(attempt.membership or {},
                                                                           epoch=change["epoch"][1]))
    return dict(json.loads((out / "summary.json").read_text()))


def _protected(job: Job) -> bool:
    """Whether the job keeps a second source of its sharded optimizer state (copies or parity)."""
    return int(job.settings.shard_redundancy) != 1 or int(job.settings.shard_parity) != 0


def _rescue_request(job: Job, attempt: Attempt) -> Optional[Callable[[], None]]:
    """What the launcher does when it first sees a worker fail: with copies or parity of the sharded
    state, ask every survivor for its snapshots (:mod:`~robustagg.training.shard_recovery`)."""
    if not _protected(job):
        return None
    from ..training.shard_recovery import rescue_folder

    def request() -> None:
        folder = rescue_folder(job.ckpt_dir, attempt.number)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".requested").touch()
    return request


def _rebuild_lost_shards(job: Job, attempt: Attempt, lost: Sequence[int], last: Optional[int]) -> str:
    """Rebuild the lost ranks' optimizer-state shards from the survivors' rescue files as a commit
    of their common step, or record why not (the restart then restores the last commit and replays).

    Returns:
        The lineage's ``state_from`` sentence of the shrink.
    """
    from ..training.shard_recovery import recover

    ranks = sorted(job.identities.index(int(w)) for w in lost if int(w) in job.identities)
    rec = recover(job.ckpt_dir, attempt.number, ranks, last_step=last, run_id=job.run_id, world=job.n)
    if rec.get("fallback"):
        log.warning("the lost shard(s) %s cannot be rebuilt without replay: %s; restoring the last commit",
                    ranks, "; ".join(rec["fallback"]))
        return "disk: the newest committed checkpoint (shard reconstruction refused: " + "; ".join(rec["fallback"]) + ")"
    if not rec["written"].startswith("step-"):
        return f"disk: the commit of step {rec['step']}, the failure's boundary (nothing to rebuild)"
    log.warning("rebuilt the optimizer-state shard(s) of rank(s) %s at step %d from %s", ranks, rec["step"],
                ", ".join(rec["sources"].values()))
    return f"rebuilt at step {rec['step']}: " + "; ".join(f"slice {k} from {v}" for k, v in rec["sources"].items())


def _named_liars(job: Job, out: Path, attempt: int) -> list[int]:
    """The worker ids the aggregate cross-check of ``attempt`` named for exclusion (its in-run
    ``lying_aggregator`` records in ``detections.jsonl``, written before the attempt stopped)."""
    named: set[int] = set()
    for rec in read_jsonl(out / "detections.jsonl"):
        if (rec.get("kind") == "lying_aggregator" and rec.get("action") == "excluded"
                and rec.get("attempt") == attempt and rec.get("source") == "in-run"):
            named.update(job.identities[int(r)] for r in rec.get("ranks", []) if 0 <= int(r) < job.n)
    return sorted(named)


def _rejoin_timing(job: Job, worker: int) -> dict[str, Any]:
    """When the replacement of ``worker`` comes back: a ``rejoin`` fault's (or the ``partition`` that cut
    it off's) ``seconds`` (``after_s``) and
    ``join_step`` (``at_step``: the survivors admit it exactly after that step); else at once, whenever ready."""
    faults = [f for f in job.faults if (f.kind == "rejoin" and int(f.rank) == worker)
              or (f.kind == "partition" and worker in f.workers)]  # a cut that heals after `seconds`
    return {"after_s": max([float(f.seconds) for f in faults], default=0.0),
            "at_step": max([int(f.join_step) for f in faults], default=0)}


#: Seconds the launcher lets workers finish the quorum protocol before it stops them after a failure.
_QUORUM_GRACE_S = 4.0


def _membership_store(job: Job, addr: str, attempt: Attempt) -> Optional[Membership]:
    """With ``on_failure=shrink``: host the run's membership store here (it outlives every attempt),
    install epoch 0 and tell the workers where it is (``attempt.membership``); else ``None``."""
    if job.settings.on_failure != "shrink":
        return None
    import torch.distributed as dist

    server = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=float(job.settings.collective_timeout_s)))
    ms = Membership(server, prefix=f"robustagg/{job.run_id}/membership")
    epoch, _ = ms.install(job.identities)
    attempt.membership = {"host": addr, "port": int(server.port), "epoch": epoch, "prefix": ms.prefix}
    return ms


def _next_membership(job: Job, ms: Membership, where: dict[str, Any], exc: WorkerFailedError, lost: list[int],
                     det: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The workers lost by the membership change after a failed attempt, and its lineage fields.

    Raises:
        QuorumLostError: no side reached a strict majority (recorded in the lineage first).
    """
    epoch = int(where["epoch"])
    reports = [str(r.get("message", "")) for r in exc.failures if r.get("type") == "QuorumLostError"]
    try:
        new_epoch, after, by = next_epoch(ms, epoch, lost, step=det.get("step"), reports=reports)
    except QuorumLostError as stop:
        CheckpointStore(Path(job.ckpt_dir)).append_lineage(
            {"event": "quorum_lost", "epoch": epoch, "members": list(ms.members(epoch)), "step": det.get("step"),
             "reports": reports, "reason": str(stop)})
        raise stop from None
    before = ms.members(epoch)
    change = {"epoch": [epoch, new_epoch], "before": list(before), "after": list(after), "decided_by": by,
              "state_from": "disk: the newest committed checkpoint every member verifies"}
    return [w for w in job.identities if w not in after], change


def _agree_on_run(job: Job, env: EnvRank) -> None:
    """Rank 0's run directory, checkpoint folder and run id become every rank's (one collective)."""
    import torch.distributed as dist

    box: list[Any] = [(job.run_dir, job.settings.ckpt_dir, job.run_id)] if env.rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    job.run_dir, job.settings.ckpt_dir, job.run_id = box[0]


def refuse_under_torchrun(s: RunSettings) -> None:
    """Refuse the membership changes torchrun cannot make (before any process group is formed).

    torchrun's elastic agent (``--nnodes=MIN:MAX``, c10d rendezvous) reacts to a lost worker by
    stopping and restarting the **whole** worker group (a new rendezvous round, ranks reassigned
    0..W'-1, a node's processes lost together): abort and restore, never a process added to a
    running group, and no record of which worker ids a new rank stands for.

    Raises:
        ConfigError: ``rejoin`` (a replacement joining the running group) or ``on_failure=shrink``
            (the survivors as a smaller group with their worker ids) under torchrun; the message
            names the key and the fix.
    """
    if s.rejoin:
        raise ConfigError(f"{s.key('rejoin')}=true is not available under torchrun: torchrun's elastic agent restarts "
                          "the whole worker group on a membership change (abort and restore) and cannot add a process "
                          "to a running group. Run the app's own launcher instead (python -m experiments.train "
                          f"trainer.mode=processes ..., without torchrun), or set {s.key('rejoin')}=false and let "
                          "torchrun restart the group from the last committed checkpoint (--max-restarts).")
    if s.on_failure == "shrink":
        raise ConfigError(f"{s.key('on_failure')}=shrink is not available under torchrun: torchrun restarts the group "
                          "with ranks reassigned and no record of which worker ids survived. Run the app's own launcher "
                          f"(without torchrun), or set {s.key('on_failure')}=restart.")


def run_torchrun(job: Job, env: EnvRank, *, on_ready: Optional[Callable[[Job], None]] = None,
                 quiet: bool = False) -> Optional[dict[str, Any]]:
    """Join the group torchrun set up through the environment; rank 0 returns the summary.

    Rank 0 settles the run (:func:`prepare`, the run lock) and shares the run directory, the
    checkpoint folder and the run id with every rank over the group before anything is written, so
    ranks that resolved a time-stamped directory a second apart still write one run. torchrun
    restarts the whole group after a failure (``--max-restarts``); a restarted worker sees
    ``TORCHELASTIC_RESTART_COUNT > 0`` and restores the newest committed checkpoint (rank 0 first
    records the previous attempt's evidence).
    """
    s = job.settings
    refuse_under_torchrun(s)
    torch.set_num_threads(int(s.threads))
    raise_on_sigterm()  # torchrun stops survivors with SIGTERM: let them write their evidence
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    job.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or job.run_id or "torchrun"
    if job.run_id == "none":
        job.run_id = "torchrun"
    if env.world_size != job.processes():
        raise ConfigError(f"torchrun started {env.world_size} processes but the job has n={job.n} workers on "
                          f"{job.processes()} process(es) (trainer.processes={job.settings.processes}); start "
                          f"{job.processes()} in total across torchrun's nodes or set trainer.processes.")
    locks: Optional[contextlib.ExitStack] = None
    message = ""
    attempt = Attempt(number=restarts, resume=s.resume if restarts == 0 else "auto",
                      fallback=s.resume if s.resume not in ("auto", "never") else "")
    if env.rank == 0:
        locks = contextlib.ExitStack()
        what = f"torchrun rank 0 (restart {restarts})"
        locks.enter_context(run_locks(job, what))  # before prepare reads the folders
        try:
            job, first, message = prepare(job, restarted=restarts > 0)
            locks.enter_context(run_locks(job, what))  # the same locks, or the fresh folder's
        except BaseException:
            locks.close()
            raise
        if restarts == 0:
            attempt = first
    timeout = float(s.collective_timeout_s)
    init_group(backend=s.backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout))
    try:
        _agree_on_run(job, env)
        if env.rank == 0:
            if message and not quiet:
                log.log(resume_log_level(message), "%s", message)
            if on_ready is not None:
                on_ready(job)
            if restarts > 0:
                out = Path(job.run_dir)
                attempt.last_step = last_step_reached(out)
                seen = {int(e["rank"]) for e in read_evidence(out / "evidence")}
                lost = [job.identities[r] for r in range(env.world_size) if r not in seen]  # no evidence: gone
                det = record_failure(out, restarts - 1, lost=lost, message="torchrun restarted the group", archive=True)
                attempt.reason = (f"torchrun restart {restarts}: {det['kind']} detected at step {det['step']}: "
                                  f"{det['message']}")
        device = device_for(job, env.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = ProcessGroupComm(device=device, timeout_s=timeout, group_id=f"{job.run_id}/attempt-{restarts}",
                                hosts=job.hosts())
        return run_worker(job, comm, device, attempt)
    finally:
        destroy_group()
        if locks is not None:
            locks.close()


def read_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``summary.json`` of a finished run (``{}`` if absent), with ``metrics.jsonl``'s record count."""
    p = Path(run_dir) / "summary.json"
    out: dict[str, Any] = dict(json.loads(p.read_text())) if p.is_file() else {}
    out["records"] = len(read_jsonl(Path(run_dir) / "metrics.jsonl"))
    return out
