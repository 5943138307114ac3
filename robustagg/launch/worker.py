"""What every worker process runs for a :class:`~robustagg.launch.Job`: build, restore, train, run files.

One body for every way in (simulated, the library's own spawned processes, torchrun): build the
job's parts, restore the newest committed checkpoint every rank agrees on, settle
``metrics.jsonl`` to the restored step, train with checkpoints, and on rank 0 write the run files
(``metrics.jsonl``, ``summary.json``, ``model.safetensors``; W&B when configured). On a failure
every rank that is still alive writes ``evidence/rank-<r>.json`` before it re-raises.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..checkpoint import CheckpointStore, append_jsonl, read_jsonl, save_state, sha256_bytes
from ..distributed import Communicator, LocalComm, ProcessGroupComm, ShardedReduction, make_reduction
from ..distributed.vote import AggregatorCheck
from ..errors import AssumptionWarning, CheckpointError, ConfigError, Interrupted, QuorumLostError
from ..functional.gram import needs_warm_up, warm_up
from ..training import (Checkpointer, FaultInjector, JsonlSink, Restored, StragglerLog, Trainer, fit, restore,
                        save_model, seed_everything, write_evidence, write_json)
from ..training.faults import PartitionedError, fired_faults
from ..training.resume import FAULT_LOG, new_workers_of
from .grow import (GrowWatch, Regroup, form_group, gather_reports, install_grow, install_leave, join_when_admitted,
                   mark_done, next_group, own_state_from_disk, receive_state, send_state, share_peer_copies,
                   wait_for_epoch)
from .identity import diff_fingerprints, optimizer_changes
from .job import Job, WorkerContext, WorkerParts, grow_job, shrink_job
from .peer import PeerMemory, absent_records, choose_own_state, committed_record
from .quorum import Membership, fmt_members
from .records import Attempt, detected_faults, settle_metrics, summary_from_records
from .schedule import MembershipWatch, members_at, parse_membership

__all__ = ["run_worker", "run_joiner", "device_for"]

log = logging.getLogger(__name__)


def device_for(job: Job, local_rank: int) -> torch.device:
    """The device of a process: ``cuda:<local_rank mod count>`` or ``cpu``."""
    if job.settings.device == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _needs_store(job: Job) -> bool:
    s = job.settings
    return bool(s.checkpoint_every > 0 or job.faults or s.max_restarts > 0 or s.resume not in ("auto", "never")
                or s.on_failure == "shrink" or _holds_files(Path(job.ckpt_dir)))


def _holds_files(folder: Path) -> bool:
    """``folder`` exists and holds more than the launch's own lock files (checkpoints, a lineage)."""
    from .lock import GUARD_NAME, LOCK_NAME

    return folder.is_dir() and any(p.name not in (LOCK_NAME, GUARD_NAME) for p in folder.iterdir())


def run_worker(job: Job, comm: Communicator, device: torch.device,
               attempt: Optional[Attempt] = None) -> Optional[dict[str, Any]]:
    """Build ``job`` for the ranks ``comm`` hosts, restore, train, and (on rank 0) write the run files.

    Every process of the group calls it (the simulated mode calls it once with a
    :class:`~robustagg.distributed.LocalComm` hosting every rank).

    Returns:
        the summary dict on rank 0, ``None`` elsewhere.

    Raises:
        RobustAggError: what training raised (integrity, desynchronisation, collective timeouts,
            requirement violations), after this rank's evidence is written.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)  # reported once, before launch
        return _run_worker(job, comm, device, attempt or Attempt(resume=job.settings.resume))


def _make_trainer(job: Job, comm: Communicator, device: torch.device, attempt: Attempt,
                  store: Optional[CheckpointStore]) -> tuple[Any, Trainer, Optional[FaultInjector]]:
    """Build ``job``'s parts for the ranks ``comm`` hosts and the trainer over them."""
    s = job.settings
    ctx = WorkerContext(job=job, rank=comm.rank, local_ranks=tuple(comm.local_ranks), device=device, comm=comm)
    parts = job.build(ctx)
    rule = parts.rule
    mode = str(s.reduction)
    if parts.protocol is not None and parts.protocol.gathers:
        if mode == "sharded":
            raise ConfigError(f"protocol {parts.protocol.name!r} needs every member's full row on every rank; "
                              "use trainer.reduction=gather (or auto).")
        mode = "gather"
    reduction = make_reduction(mode, rule, comm, on_nonfinite=str(s.on_nonfinite))
    reduction.check = AggregatorCheck(replicas=int(s.aggregator_replicas), on_mismatch=str(s.on_aggregate_mismatch),
                                      on_liar=str(s.on_lying_aggregator))
    sharded_metrics = False
    if isinstance(reduction, ShardedReduction):
        reduction.metrics = bool(s.metrics)  # its moments and shares cost collectives on every rank
        sharded_metrics = reduction.metrics and comm.num_processes > 1  # its metrics take a robust Gram
    if sharded_metrics or needs_warm_up(rule, parts.byzantine) or bool(s.metrics):
        warm_up()  # the compiled kernels' first-call cost (Gram; the metrics' shares) must not land in a timed step
    ids = {r: job.identities[r] for r in comm.local_ranks}
    injector = None
    if job.faults:
        injector = FaultInjector(job.faults, worker_ids=ids, log=None if store is None else store.root / FAULT_LOG,
                                 process_rank=comm.rank, attempt=attempt.number)
    extra: dict[str, Any] = {}
    if parts.loss_fn is not None:
        extra["loss_fn"] = parts.loss_fn
    if parts.batch_loss is not None:
        extra["batch_loss"] = parts.batch_loss
    if parts.root is not None:
        extra["root"] = parts.root
    if parts.protocol is not None:
        extra["protocol"] = parts.protocol
    batched = _batched_setting(job, parts, device, comm)
    trainer = Trainer(parts.model, parts.optimizer, reduction, parts.shards, batch_size=int(s.batch_size),
                      num_classes=int(parts.num_classes), seed=int(s.seed), scheduler=parts.scheduler,
                      worker_momentum=float(s.worker_momentum), byzantine=parts.byzantine, metrics=bool(s.metrics),
                      identities=ids, injector=injector, measure_bias=bool(s.measure_bias),
                      precision=str(s.precision), batched_gradients=batched,
                      state_sharding=str(s.state_sharding), shard_redundancy=int(s.shard_redundancy),
                      shard_parity=int(s.shard_parity), **extra)
    return parts, trainer, injector


def _batched_setting(job: Job, parts: WorkerParts, device: torch.device, comm: Communicator) -> bool:
    """``settings.batched_gradients`` as ``True``/``False``: ``"auto"`` is decided here, in every process,
    on the built parts (:func:`~robustagg.training.batched.resolve_batched`: the model, protocol,
    precision and a dry run on two examples of the first hosted shard; every process decides the
    same, the checks depending on the model's modules, the protocol and the precision). The decision
    replaces ``"auto"`` in this process's job (settings, the fingerprint's
    ``trainer.batched_gradients`` where present, ``meta["batched_gradients_reason"]``: the summary)
    and is logged once by rank 0. A value the app or the launcher already decided is returned as is.

    Raises:
        ConfigError: ``settings.batched_gradients`` is not ``auto``, ``true`` or ``false``.
    """
    from ..training.batched import KEY, example_batch, parse_batched, resolve_batched, run_shapes

    s = job.settings
    value = parse_batched(s.batched_gradients, key=s.key("batched_gradients"))
    if value != "auto":
        return bool(value)
    sizes, workers = run_shapes(int(s.batch_size), [len(getattr(sh, "y", ())) for sh in parts.shards.values()],
                                job.n)  # a worker's decision must hold in any mode: up to every worker in one call
    decision = resolve_batched("auto", parts.model, protocol=parts.protocol, precision=str(s.precision),
                               example=example_batch(parts.shards, device), loss_fn=parts.loss_fn,
                               batch_loss=parts.batch_loss, batch_sizes=sizes, workers=workers)
    s.batched_gradients = decision.on
    if KEY in job.fingerprint:
        job.fingerprint[KEY] = decision.on
    job.meta["batched_gradients_reason"] = decision.describe()
    if comm.is_main:
        log.info("%s", decision.line())
    return decision.on


def _aggregator_cost(job: Job, trainer: Trainer, comm: Communicator) -> dict[str, Any]:
    """The summary's ``aggregator_check``: the requirement (:meth:`Job.aggregator_requirement`) and, for a
    sharded process group, what rank 0 sends per step and how many coordinates it aggregates, with
    ``r_a`` replicas and with one (``*_r1``)."""
    from ..distributed.sharded import shard_bounds
    from ..distributed.vote import held_slices, sent_bytes

    block = job.aggregator_requirement()
    red = trainer.reduction
    d, world, r = trainer.num_parameters(), comm.world_size, int(job.settings.aggregator_replicas)
    if isinstance(red, ShardedReduction) and comm.num_processes == world > 1 and d >= red.min_d:
        size = trainer.params[0].element_size() if trainer.params else 4
        sizes = [b - a for a, b in shard_bounds(d, world)]
        block.update(sent_bytes_per_step=sent_bytes(d, world, r, size), sent_bytes_per_step_r1=sent_bytes(d, world, 1, size),
                     aggregated_coordinates=sum(sizes[s] for s in held_slices(0, world, r)),
                     aggregated_coordinates_r1=sizes[0])
    return block


def _state_sharding(trainer: Trainer) -> dict[str, Any]:
    """The summary's ``state_sharding``: the mode and rank 0's optimizer-state bytes, with the
    unsharded optimizer's for comparison (:mod:`~robustagg.training.state_sharding`)."""
    from ..training.state_sharding import optimizer_state_bytes

    shard = trainer.optimizer_shard
    if shard is None:
        held = optimizer_state_bytes(trainer.optimizer)
        return {"mode": "none", "optimizer_state_bytes": held, "optimizer_state_bytes_unsharded": held}
    return {"mode": "optimizer", "optimizer_state_bytes": shard.state_bytes(),
            "optimizer_state_bytes_unsharded": shard.unsharded_bytes(), "coordinates": shard.end - shard.start,
            "d": shard.d}


def _checkpointer(job: Job, attempt: Attempt, store: Optional[CheckpointStore], injector: Optional[FaultInjector],
                  membership: Optional[tuple[Membership, int]], parent: Optional[str],
                  absent: Optional[dict[str, Any]] = None) -> Optional[Checkpointer]:
    s = job.settings
    if store is None or int(s.checkpoint_every) <= 0:
        return None
    meta = _checkpoint_meta(job, attempt, membership, absent)
    guard = None
    if membership is not None:
        guard = (lambda step, ms=membership[0], e=int(membership[1]): ms.claim_commit(e, step))
    return Checkpointer(store, every=int(s.checkpoint_every), meta=meta, injector=injector, parent=parent, guard=guard)


def _checkpoint_meta(job: Job, attempt: Attempt, membership: Optional[tuple[Membership, int]],
                     absent: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The manifest fields every checkpoint of this job carries (a rescue commit's too)."""
    roles = {str(r): ("byzantine" if r in job.byzantine_ranks else "honest") for r in range(job.n)}
    meta = {"run_id": job.run_id, "mode": job.settings.mode, "roles": roles, "fingerprint": job.fingerprint,
            "config_hash": _fp_hash(job), "code_revision": job.meta.get("code_revision", ""),
            "restart_count": attempt.number, "identities": list(job.identities)}
    if membership is not None:
        meta["membership_epoch"] = int(membership[1])
    absent = {w: r for w, r in (absent or {}).items() if int(w) not in job.identities}
    if absent:  # trainer.peer_copy: the committed record of every absent worker's own state travels on
        meta["absent_parts"] = absent
    return meta


class _Rescue:
    """This rank's part of a sharded-state rescue (:mod:`~robustagg.training.shard_recovery`).

    When the group fails, the rank writes its snapshots to ``rescue/attempt-<k>/rank-<r>.pt``:
    from its own error handler, or from a watcher thread as soon as the launcher asks (the file
    ``.requested`` appears in that folder), since a rank blocked in a collective with a dead peer
    may never reach its handler before the launcher stops it. Written once, atomically.
    """

    def __init__(self, job: Job, attempt: Attempt, trainer: Trainer,
                 membership: Optional[tuple[Membership, int]]) -> None:
        from ..training.shard_recovery import rescue_folder

        self.folder = rescue_folder(job.ckpt_dir, attempt.number)
        self.trainer, self.meta = trainer, _checkpoint_meta(job, attempt, membership)
        self.lock, self.done, self.stop = threading.Lock(), False, threading.Event()
        self.thread = threading.Thread(target=self._watch, name="shard-rescue", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            if (self.folder / ".requested").exists():
                self.write()
                return

    def write(self) -> None:
        """Write this rank's rescue file (once; errors are logged, never raised)."""
        with self.lock:
            if self.done or self.trainer.protection is None:
                return
            self.done = True
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                save_state(self.folder / f"rank-{self.trainer.comm.rank}.pt",
                           self.trainer.protection.payload(self.meta))
            except Exception as exc:  # the failure being handled must surface, not this
                log.warning("could not write the sharded-state rescue file: %s", exc)

    def close(self) -> None:
        self.stop.set()


def _apply_allowed_changes(job: Job, trainer: Trainer, built: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """``resume_changes=allow``: set every changed ``optimizer.<name>`` in the restored param groups
    to the value this run's optimizer was built with (the restored state would keep the old one).

    Raises:
        ConfigError: a changed ``optimizer.<name>`` is not a key of the optimizer's param groups.
    """
    old = manifest.get("fingerprint")
    if not isinstance(old, dict) or not job.fingerprint:
        return
    wanted = optimizer_changes(diff_fingerprints(old, job.fingerprint))
    groups = trainer.optimizer.param_groups
    for name in wanted:
        if len(built) != len(groups) or any(name not in g for g in built):
            raise ConfigError(f"optimizer.{name} changed (trainer.resume_changes=allow) but the optimizer's param "
                              f"groups have no {name!r}, so the change cannot reach the restored optimizer; start "
                              f"a new run with the new value instead.")
        for g, b in zip(groups, built):
            g[name] = b[name]
    if wanted and trainer.comm.is_main:
        log.warning("resume_changes=allow: the restored optimizer now trains with %s",
                    ", ".join(f"optimizer.{k}={v!r}" for k, v in wanted.items()))


def run_joiner(job: Job, device: torch.device, attempt: Attempt, joiner: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A replacement for a lost worker (``trainer.rejoin``): join the running group, then train with it.

    See :mod:`~robustagg.launch.grow` for the protocol. Returns the summary if this process ends
    as rank 0, else ``None`` (also when the run ended before it was admitted).

    Raises:
        QuorumLostError: not admitted (another membership was installed, or nothing happened in time).
        CheckpointError: no committed checkpoint holds its own state, or the peer's state does not
            match the peer's manifest.
        RobustAggError: what training raised afterwards.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)
        return _run_worker(job, None, device, attempt, joiner=joiner)


def _run_worker(job: Job, comm: Optional[Communicator], device: torch.device, attempt: Attempt,
                joiner: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    s = job.settings
    torch.set_num_threads(int(s.threads))
    seed_everything(int(s.seed))
    store = CheckpointStore(Path(job.ckpt_dir), keep=int(s.checkpoint_keep)) if _needs_store(job) else None
    grown: Optional[dict[str, Any]] = None
    if joiner is None:
        assert comm is not None
        membership = _join_membership(job, attempt, {r: job.identities[r] for r in comm.local_ranks})
        parts, trainer, injector = _make_trainer(job, comm, device, attempt, store)
    else:
        joined = _join_running_group(job, attempt, joiner, device, store)
        if joined is None:
            return None  # the run ended before this replacement was admitted
        job, comm, parts, trainer, injector, membership, grown = joined
    ids = {r: job.identities[r] for r in comm.local_ranks}
    comm.group_id = comm.group_id or f"{job.run_id}/attempt-{attempt.number}"
    out = Path(job.run_dir)
    sinks: list[Any] = []
    wandb_sink = None

    def detect(rec: dict[str, Any]) -> None:
        append_jsonl(out / "detections.jsonl", {**rec, "attempt": attempt.number, "source": "in-run"})

    rescue = _Rescue(job, attempt, trainer, membership) if trainer.protection is not None and joiner is None else None
    try:
        trainer.check_parameters()  # every rank starts from the same parameters (a joiner: the peer's)
        restored = Restored()
        if joiner is not None:
            restored = Restored(step=trainer.step_id)
        elif store is not None:
            lineage_extra = {"experiment_changes": attempt.changes} if attempt.changes else None
            built = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
            restored = restore(trainer, store, request=attempt.resume, fallback=attempt.fallback or None,
                               restart=attempt.number, reason=attempt.reason, last_step=attempt.last_step,
                               extra=lineage_extra, new_workers=s.resume_changes == "allow")
            fresh = new_workers_of(restored.manifest, job.identities) if restored.checkpoint else []
            if comm.is_main and fresh:  # a resume into a larger group (resume_changes=allow)
                store.append_lineage({"event": "new_workers", "step": restored.step, "workers": fresh,
                                      "checkpoint": restored.checkpoint, "own_state": "fresh: data position 0, RNG "
                                      "stream from the seed and the worker id, no momentum (the checkpoint never had "
                                      "them)"})
                log.warning("resume: worker(s) %s are new to checkpoint %s and start with fresh own state",
                            fresh, restored.checkpoint)
            if s.resume_changes == "allow":
                _apply_allowed_changes(job, trainer, built, restored.manifest)
            if comm.is_main and attempt.shrink is not None:
                store.append_lineage({**attempt.shrink, "step": restored.step, "restart": attempt.number})
        if comm.is_main and joiner is None:
            settle_metrics(out / "metrics.jsonl", restored.step)
            if restored.checkpoint is not None:
                reached = attempt.last_step if attempt.last_step is not None else restored.step
                replay = max(0, min(int(s.steps), reached) - restored.step)
                log.warning("resumed from step %d (checkpoint %s, verified), replaying %d step(s)",
                            restored.step, restored.checkpoint, replay)
        parent = restored.checkpoint
        pending = [int(j["worker"]) for j in attempt.joiners if int(j["worker"]) not in job.identities]
        memory, absent = _seed_peer_memory(job, store, restored, ids) if joiner is None else (None, {})
        schedule = parse_membership(s.membership, key=s.key("membership"), n=job.n) if s.membership else ()
        if schedule and restored.step > 0:
            raise ConfigError(f"a run with {s.key('membership')} starts from step 0: resuming it from step "
                              f"{restored.step} would lose the absent workers' frozen state; set "
                              f"{s.key('resume')}=never or use a fresh run directory.")
        base, base_byz = tuple(job.identities), tuple(job.byzantine_ids)
        absent_parts: dict[int, Any] = {}  # a scheduled absence: the absent workers' frozen own state
        t0 = time.perf_counter()
        while True:
            if schedule and trainer.step_id < int(s.steps):
                want = members_at(schedule, base, trainer.step_id + 1)
                if want != tuple(sorted(job.identities)):
                    job, comm, parts, trainer, injector = _regroup_scheduled(
                        job, attempt, trainer, device, store, want, base_byz, absent_parts)
            main = comm.is_main
            checkpointer = _checkpointer(job, attempt, store, injector, membership, parent, absent)
            if checkpointer is not None and restored.checkpoint is not None and restored.step == trainer.step_id:
                checkpointer.last_saved = restored.step
            stragglers = StragglerLog(factor=float(s.straggler_factor)) if main else None
            if main and not sinks:
                sinks.append(JsonlSink(out / "metrics.jsonl"))
                if str(s.logger.get("name", "none")) == "wandb":
                    from .wandb_sink import WandbSink

                    wandb_sink = WandbSink(s.logger, job.config, str(out), name=job.name or out.name)
                    sinks.append(wandb_sink)
            watch: list[Any] = []
            if schedule:
                watch = [MembershipWatch(schedule, base, last_step=int(s.steps))]
            group: list[int] = []
            if pending and membership is not None:  # one grow per group of joiners with the same join_step
                group, at = next_group(attempt.joiners, pending)
                watch = [GrowWatch(membership[0], membership[1], group, last_step=int(s.steps), at_step=at,
                                   wait_s=max(120.0, 4 * float(s.collective_timeout_s)))]
            try:
                result = fit(trainer, steps=max(0, int(s.steps) - trainer.step_id),
                             evaluate=parts.evaluate if main else None, eval_every=int(s.eval_every), sinks=sinks,
                             progress=bool(s.progress), param_check_every=int(s.param_check_every),
                             assumption_violated=job.assumption_violated, callbacks=[*parts.callbacks, *watch],
                             checkpointer=checkpointer, stragglers=stragglers, on_detect=detect)
                break
            except Regroup as at:
                if main:
                    for sink in sinks:
                        sink.close()
                    sinks.clear()
                parent = checkpointer.parent if checkpointer is not None else parent
                if schedule:
                    continue  # the loop's head rebuilds the group for the next step's members
                assert membership is not None
                job, comm, parts, trainer, injector, membership, grew = _grow_survivor(
                    job, attempt, trainer, device, store, membership, group, at.step, memory)
                grown = grew or grown  # None: every joiner of this grow left (rejoin_refused in the lineage)
                pending = [w for w in pending if w not in group]
                restored = Restored(step=trainer.step_id, checkpoint=None)
        main = comm.is_main
        if membership is not None and main:
            _release_joiners(membership, attempt)
        if not main:
            return None
        summary = result.to_dict()
        summary_from_records(summary, read_jsonl(out / "metrics.jsonl"))
        summary["steps_this_run"] = trainer.step_id - restored.step
        summary["steps"] = trainer.step_id
        summary["run_seconds"] = time.perf_counter() - t0
        summary.update(dict(job.meta))
        summary.update({"n": job.n, "f": job.f, "byzantine": len(job.byzantine_ranks),
                        "byzantine_ranks": list(job.byzantine_ranks), "mode": s.mode, "seed": int(s.seed),
                        "num_parameters": trainer.num_parameters(), "violations": job.violations,
                        **trainer.protocol.describe(), "processes": comm.num_processes,
                        "run_dir": str(out), "run_id": job.run_id, "n_initial": job.n_initial,
                        "workers": list(job.identities), "restarts": attempt.number,
                        "resumed_from": restored.step if restored.checkpoint else None,
                        "resumed_checkpoint": restored.checkpoint,
                        "lineage": [] if store is None else store.lineage(),
                        "faults": {"injected": fired_faults(None if store is None else store.root / FAULT_LOG),
                                   **detected_faults(read_jsonl(out / "detections.jsonl"))},
                        "straggler": stragglers.report() if stragglers is not None else {},
                        "aggregator_check": _aggregator_cost(job, trainer, comm),
                        "state_sharding": _state_sharding(trainer),
                        "batched_gradients": trainer.batched is not None,
                        "checkpoint_dir": None if store is None else str(store.root)})
        if grown is not None:
            summary["grown"] = grown
        if "batched_gradients_reason" not in summary:  # a value set by hand (the app's and auto's are in meta)
            summary["batched_gradients_reason"] = (f"{'on' if trainer.batched is not None else 'off'} (set: "
                                                   f"{s.key('batched_gradients')}={str(s.batched_gradients).lower()})")
        save_model(parts.model, out / "model.safetensors")
        write_json(out / "summary.json", summary)
        if wandb_sink is not None:
            wandb_sink.summary(summary)
        return summary
    except BaseException as exc:
        if wandb_sink is not None:
            wandb_sink.failed = True
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):  # a requested stop is not a failure
            if membership is not None and comm.is_main:
                try:
                    _release_joiners(membership, attempt)  # a replacement still waiting to join may leave now
                except Exception as mark_exc:  # the stop must still be reported as a stop
                    log.warning("could not tell waiting replacements that the run stopped: %s", mark_exc)
            raise
        if rescue is not None:
            rescue.write()  # the snapshots a shrink can rebuild a lost rank's shard from
        decision, lost_quorum = _decide_membership(job, membership, injector, ids, trainer, exc)
        try:
            more = {} if decision is None else {"quorum": decision}
            write_evidence(out / "evidence", trainer, lost_quorum or exc, attempt=attempt.number, run_id=job.run_id,
                           **more)
        except Exception as ev_exc:  # evidence must never hide the failure
            log.warning("could not write evidence: %s", ev_exc)
        if lost_quorum is not None:
            raise lost_quorum from exc
        raise
    finally:
        if rescue is not None:
            rescue.close()
        for sink in sinks:
            sink.close()


def _regroup_scheduled(job: Job, attempt: Attempt, trainer: Trainer, device: torch.device,
                       store: Optional[CheckpointStore], want: tuple[int, ...], byzantine: Sequence[int],
                       absent_parts: dict[int, Any]) -> tuple[Any, ...]:
    """Simulated mode, a ``trainer.membership`` boundary: the group of the next step's members ``want``.

    The job is recomputed as after a failure (:func:`shrink_job` for the leavers, :func:`grow_job`
    for the workers back: normalisation, effective batch, the rule's requirement); the replicated
    state carries over; a leaver's own state (data position, momentum, RNG streams, protocol
    state) is set aside in ``absent_parts`` unchanged and given back when it returns (see
    :mod:`~robustagg.launch.schedule`). One ``shrink`` / ``grow`` lineage record per change.
    """
    step = trainer.step_id
    state = trainer.state_dict()
    own = {**absent_parts, **{int(w): p for w, p in state["local"]["workers"].items()}}
    gone = [w for w in job.identities if w not in want]
    back = [w for w in want if w not in job.identities]
    records: list[dict[str, Any]] = []
    if gone:
        job, rec = shrink_job(job, gone, reason=f"trainer.membership: worker(s) {gone} absent from step {step + 1}")
        records.append(rec)
    if back:
        job, rec = grow_job(job, back, byzantine=[w for w in back if w in byzantine],
                            reason=f"trainer.membership: worker(s) {back} back at step {step + 1}")
        records.append(rec)
    comm = LocalComm(job.n, device=device)
    parts, new_trainer, injector = _make_trainer(job, comm, device, attempt, store)
    new_trainer.load_state_dict({"replicated": state["replicated"],
                                 "local": {**state["local"], "workers": {w: own[w] for w in want}}})
    absent_parts.clear()
    absent_parts.update({w: p for w, p in own.items() if w not in want})
    if store is not None:
        for rec in records:
            store.append_lineage({**rec, "step": step, "decided_by": "the trainer.membership schedule",
                                  "source": "in-process", "state_from": "in-process: the schedule's own state, "
                                  "an absent worker's frozen since it left"})
    return job, comm, parts, new_trainer, injector


def _new_group(job: Job, ms: Membership, epoch: int, members: tuple[int, ...], me: int, device: torch.device
               ) -> ProcessGroupComm:
    s = job.settings
    timeout = float(s.collective_timeout_s)
    form_group(ms, epoch, members, me, backend=s.backend, timeout_s=timeout)
    return ProcessGroupComm(device=device, timeout_s=timeout, group_id=f"{job.run_id}/epoch-{epoch}")


def _seed_peer_memory(job: Job, store: Optional[CheckpointStore], restored: Restored, ids: dict[int, int]
                      ) -> tuple[Optional[PeerMemory], dict[str, Any]]:
    """``trainer.peer_copy`` on a survivor: copy the absent workers' own state it holds (ring) from the
    restored commit into memory; the ``absent_parts`` records its commits carry (:mod:`~robustagg.launch.peer`)."""
    if not (job.settings.peer_copy and store is not None and restored.checkpoint is not None):
        return None, {}
    ring, members = tuple(range(job.n_initial)), tuple(job.identities)
    memory = PeerMemory(min(ids.values()))
    try:
        for problem in memory.seed(store, restored.checkpoint, members, ring):
            log.warning("peer copy: %s", problem)
        return memory, absent_records(store, restored.checkpoint, members, ring)
    except CheckpointError as exc:  # restored from a folder outside the store (an explicit path): no copy
        log.warning("peer copy: not taken (%s); a replacement uses its disk copy", exc)
        return None, {}


def _grow_survivor(job: Job, attempt: Attempt, trainer: Trainer, device: torch.device, store: Optional[CheckpointStore],
                   membership: tuple[Membership, int], joiners: list[int], step: int,
                   memory: Optional[PeerMemory] = None) -> tuple[Any, ...]:
    """A survivor at the agreed boundary: new epoch, new group, rebuilt trainer, state sent to the joiners."""
    ms, epoch = membership
    me = job.identities[trainer.comm.local_ranks[0]]
    began = time.time()  # the boundary: timed for experiments.bench_recovery (regroup_s, transfer_s)
    state = trainer.state_dict()  # coherent: every survivor completed step `step`
    timeout = float(job.settings.collective_timeout_s)
    if trainer.is_main:
        members = install_grow(ms, epoch, joiners)
    else:
        members = wait_for_epoch(ms, epoch + 1, timeout_s=timeout)
    byz = [int(j["worker"]) for j in attempt.joiners if j.get("byzantine")]
    ring = tuple(range(job.n_initial))
    new_job, record = grow_job(job, joiners, byzantine=byz, reason=f"rejoin of worker(s) {joiners}")
    survivors = [w for w in members if w not in joiners]
    comm = _new_group(new_job, ms, epoch + 1, members, me, device)
    parts, new_trainer, injector = _make_trainer(new_job, comm, device, attempt, store)
    _exchange_shards(new_trainer, state)  # sharded optimizer state: every old shard, for the new slicing
    new_trainer.load_state_dict(state)
    src = sorted(members).index(min(survivors))
    sent = time.time()
    send_state(state["replicated"] if comm.rank == src else None, src=src, src_worker=min(survivors))
    if job.settings.peer_copy:
        share_peer_copies(memory, joiners, _holders(ms, attempt), members, ring)
    reports = [r for r in gather_reports(None) if r is not None]
    now = epoch + 1
    unplaced = _unplaced(reports)
    if unplaced:  # they leave with their evidence; the others go on without them
        new_job, comm, parts, new_trainer, injector, members = _without(
            job, new_trainer, ms, now, unplaced, me, device, attempt, store)
        now += 1
        placed = [r for r in reports if r["worker"] not in unplaced]
        if comm.is_main and store is not None:
            for r in reports:
                if r["worker"] in unplaced:
                    why = r.get("refused") or "no own state"
                    store.append_lineage({"event": "rejoin_refused", "step": int(step), "worker": r["worker"],
                                          "epoch": [epoch + 1, now], "reason": why, "members": list(members)})
                    append_jsonl(Path(job.run_dir) / "detections.jsonl", {
                        "kind": "rejoin_refused", "step": int(step), "ranks": [r["worker"]], "message": why[:500],
                        "attempt": attempt.number, "source": "in-run", "action": "left out"})
        reports = placed
        if placed:
            new_job, record = grow_job(job, [r["worker"] for r in placed], byzantine=byz,
                                       reason=f"rejoin of worker(s) {[r['worker'] for r in placed]}")
    new_trainer.check_parameters()  # the joiners take part only once every digest agrees
    done = time.time()
    if not reports:  # nobody joined after all: no grow to record
        return new_job, comm, parts, new_trainer, injector, (ms, now), None
    grown = {**record, "step": int(step), "epoch": [epoch, now], "decided_by": f"every member of epoch {epoch}",
             "state_from": f"live peer worker {min(survivors)} over the process group (SHA-256 checked by the joiner)",
             "own_state_from": {str(r["worker"]): r["checkpoint"] for r in reports},
             "sources": {"replicated": f"peer {min(survivors)}",
                         "own": {str(r["worker"]): r["source"] for r in reports},
                         **_sharded_source(new_trainer)}}
    grown.update(time=done, regroup_s=done - began, transfer_s=done - sent)  # from the boundary / the send to agreed digests
    if comm.is_main and store is not None:
        for r in reports:
            if r.get("refused"):
                store.append_lineage({"event": "peer_copy_refused", "step": int(step), "worker": r["worker"],
                                      "reason": r["refused"], "used": r["source"]})
        store.append_lineage(grown)
    return new_job, comm, parts, new_trainer, injector, (ms, now), grown


def _holders(ms: Membership, attempt: Attempt) -> tuple[int, ...]:
    """The group that restored in this attempt and took the peer copies (the attempt's epoch)."""
    return ms.members(int((attempt.membership or {})["epoch"]))


def _unplaced(reports: list[dict[str, Any]]) -> list[int]:
    """The joiners of a grow that have no usable state (every rank of the new group read the same reports)."""
    return sorted(int(r["worker"]) for r in reports if not r["source"])


def _without(base: Job, trainer: Trainer, ms: Membership, epoch: int, leaving: list[int], me: int,
             device: torch.device, attempt: Attempt, store: Optional[CheckpointStore]) -> tuple[Any, ...]:
    """Every member of epoch ``epoch`` that stays, after some joiners could not take part: install
    epoch ``epoch + 1`` without them, form its group and carry this trainer's state over.

    Args:
        base: the job before this grow (the survivors'). trainer: this process's trainer of ``epoch``
            (a survivor's own state; a staying joiner's, loaded from the peer).
        leaving: the joiners that leave (their own processes return without training).

    Returns:
        ``(job, comm, parts, trainer, injector, members)`` of epoch ``epoch + 1``.
    """
    state = trainer.state_dict()
    timeout = float(base.settings.collective_timeout_s)
    members = install_leave(ms, epoch, leaving) if trainer.is_main else wait_for_epoch(ms, epoch + 1,
                                                                                        timeout_s=timeout)
    back = [w for w in members if w not in base.identities]
    byz = [int(j["worker"]) for j in attempt.joiners if j.get("byzantine")]
    job = grow_job(base, back, byzantine=byz, reason=f"rejoin of worker(s) {back}")[0] if back else base
    comm = _new_group(job, ms, epoch + 1, members, me, device)
    parts, new_trainer, injector = _make_trainer(job, comm, device, attempt, store)
    _exchange_shards(new_trainer, state)
    new_trainer.load_state_dict(state)
    log.warning("worker(s) %s could not take part in epoch %d; going on as %s", leaving, epoch, fmt_members(members))
    return job, comm, parts, new_trainer, injector, members


def _exchange_shards(trainer: Trainer, state: Optional[dict[str, Any]]) -> Optional[list[dict[str, Any]]]:
    """A new group's members (every one calls it, at the same point): with sharded optimizer state,
    all-gather every member's shard of the old slicing (a joiner has none), so that each can cut
    its new slice out of them (:func:`~robustagg.training.state_sharding.state_for`). ``state``
    (a member's :meth:`~robustagg.training.Trainer.state_dict`) gets them as
    ``replicated["optimizer_shards"]``.

    Moves every shard to every member once per membership change (O(d) state bytes per rank,
    briefly). Returns the shards, or ``None`` without sharded state.

    Raises:
        CollectiveError-like ``RuntimeError``: a member failed during the exchange.
    """
    if trainer.optimizer_shard is None:
        return None
    import torch.distributed as dist

    mine = None if state is None else state["local"].get("optimizer_shard")
    got: list[Any] = [None] * trainer.comm.world_size
    dist.all_gather_object(got, mine, group=getattr(trainer.comm, "group", None))
    shards = [g for g in got if g is not None]
    if state is not None:
        state["replicated"] = {**state["replicated"], "optimizer_shards": shards}
    return shards


def _sharded_source(trainer: Trainer) -> dict[str, str]:
    """A grow record's word on where the sharded optimizer state came from (``{}`` without it)."""
    if trainer.optimizer_shard is None:
        return {}
    return {"optimizer_state": f"the members' shards, all-gathered and re-sliced into {len(trainer.optimizer_shard.bounds)}"}


def _release_joiners(membership: tuple[Membership, int], attempt: Attempt) -> None:
    """Rank 0 when the run ends or stops: mark every epoch of this attempt done, so that a replacement
    still waiting to be admitted under any of them exits (it is not a member: it takes no part in the stop)."""
    for e in range(int((attempt.membership or {}).get("epoch", membership[1])), membership[1] + 1):
        mark_done(membership[0], e)


def _join_running_group(job: Job, attempt: Attempt, joiner: dict[str, Any], device: torch.device,
                        store: Optional[CheckpointStore]) -> Optional[tuple[Any, ...]]:
    """A replacement process: ask to join, wait for the survivors' boundary, receive and verify the state."""
    s = job.settings
    where = attempt.membership
    if where is None or store is None:
        raise ConfigError("a replacement worker needs the membership store and the checkpoint folder "
                          "(trainer.on_failure=shrink, trainer.rejoin=true).")
    me = int(joiner["worker"])
    timeout = float(s.collective_timeout_s)
    ms = Membership.connect(str(where["host"]), int(where["port"]), timeout_s=timeout,
                            prefix=str(where.get("prefix", "robustagg/membership")))
    epoch = int(where["epoch"])
    time.sleep(float(joiner.get("after_s", 0.0)))  # a `rejoin` fault: the worker comes back after S seconds
    own: Optional[dict[str, Any]] = None
    own_from = ""
    try:  # before it is admitted, a replacement that cannot join must not stop the running group
        if s.peer_copy:  # a committed record of its state must exist (the copy is read once admitted)
            if committed_record(store, me) is None:
                raise CheckpointError(f"no committed checkpoint in {store.root} holds or records worker {me}'s state; "
                                      "it cannot rejoin.")
        else:
            own, own_from = own_state_from_disk(store, me)  # before asking: something must hold its own state
        admitted = join_when_admitted(ms, epoch, me, timeout_s=max(120.0, 4 * timeout))
    except (QuorumLostError, CheckpointError) as refused:
        log.warning("worker %d does not rejoin: %s", me, refused)
        store.append_lineage({"event": "rejoin_refused", "worker": me, "epoch": epoch, "reason": str(refused)})
        return None
    if admitted is None:
        return None
    epoch, members = admitted  # an earlier grow of this attempt may have admitted other joiners first
    joiners = [w for w in members if w not in ms.members(epoch)]
    byz = [int(j["worker"]) for j in attempt.joiners if j.get("byzantine")]
    new_job, record = grow_job(job, [w for w in members if w not in job.identities], byzantine=byz,
                               reason=f"rejoin of worker(s) {joiners}")
    record.update(old_n=len(ms.members(epoch)), joined=joiners)  # this grow's, not the attempt's so far
    record["effective_batch"][0] = record["old_n"] * int(s.batch_size)
    comm = _new_group(new_job, ms, epoch + 1, members, me, device)
    parts, trainer, injector = _make_trainer(new_job, comm, device, attempt, store)
    shards = _exchange_shards(trainer, None)  # the survivors' shards of the optimizer state (it holds none)
    survivors = [w for w in members if w not in joiners]
    src = sorted(members).index(min(survivors))
    message = send_state(None, src=src, src_worker=min(survivors))
    why: Optional[str] = None
    try:
        replicated: Optional[dict[str, Any]] = receive_state(message)
    except CheckpointError as refused:  # the live peer's bytes do not match its manifest: keep the evidence
        replicated, why = None, str(refused)
        man, payload = message["manifest"], message["payload"]
        write_json(Path(job.run_dir) / "evidence" / f"rejoin-{me}.json", {
            "kind": "transfer_refused", "worker": me, "epoch": epoch + 1, "from_worker": int(man["from_worker"]),
            "manifest": {k: man[k] for k in ("size", "sha256", "step")},
            "received": {"size": len(payload), "sha256": sha256_bytes(payload)}, "message": why, "time": time.time()})
        log.warning("%s", why)
    source = "disk"
    if s.peer_copy:  # its disk copy as of now, or the holder's in-memory copy when that is newer
        peers = share_peer_copies(None, joiners, _holders(ms, attempt), members, tuple(range(job.n_initial)))
        try:
            disk: Optional[tuple[dict[str, Any], str]] = own_state_from_disk(store, me)
        except CheckpointError:
            disk = None
        if replicated is not None:
            own, source, own_from, refusal = choose_own_state(me, disk, peers.get(me), committed_record(store, me))
            if refusal is not None:
                write_json(Path(job.run_dir) / "evidence" / f"rejoin-{me}.json", {**refusal, "epoch": epoch + 1})
                log.warning("%s", refusal["message"])
            why = None if refusal is None else refusal["message"]
    if replicated is None:
        own = None  # without the replicated state it cannot take part, whatever its own state
    reports = [r for r in gather_reports({"worker": me, "source": source if own is not None else "",
                                          "checkpoint": own_from, "refused": why}) if r is not None]
    unplaced = _unplaced(reports)
    if me in unplaced:  # it cannot take part: it leaves, and the others go on without it
        log.warning("worker %d does not rejoin: %s", me, why or "no own state")
        return None
    assert own is not None and replicated is not None
    if shards is not None:
        replicated = {**replicated, "optimizer_shards": shards}
    trainer.load_state_dict({"replicated": replicated, "local": own})
    now = epoch + 1
    if unplaced:  # another joiner of this grow leaves: the rest form the next epoch without it
        new_job, comm, parts, trainer, injector, members = _without(job, trainer, ms, now, unplaced, me, device,
                                                                    attempt, store)
        now += 1
        joiners = [w for w in joiners if w not in unplaced]
        record.update(new_n=len(members), joined=joiners, members=list(members))
    grown = {**record, "epoch": [epoch, now], "own_state_from": {str(me): own_from},
             "sources": {"replicated": f"peer {min(survivors)}", "own": {str(me): source}, **_sharded_source(trainer)}}
    return new_job, comm, parts, trainer, injector, (ms, now), grown


def _join_membership(job: Job, attempt: Attempt, ids: dict[int, int]) -> Optional[tuple[Membership, int]]:
    """Connect to the launcher's membership store; refuse to start outside the committed membership."""
    where = attempt.membership
    if where is None:
        return None
    ms = Membership.connect(str(where["host"]), int(where["port"]), timeout_s=float(job.settings.collective_timeout_s),
                            prefix=str(where.get("prefix", "robustagg/membership")))
    epoch = int(where["epoch"])
    members = ms.members(epoch)
    outside = sorted(w for w in ids.values() if w not in members)
    if outside:
        raise QuorumLostError(f"worker(s) {outside} are not in the committed membership {fmt_members(members)} of "
                              f"epoch {epoch}; a worker outside it must not take part (it would split the group).")
    return ms, epoch


def _decide_membership(job: Job, membership: Optional[tuple[Membership, int]], injector: Optional[FaultInjector],
                       ids: dict[int, int], trainer: Trainer, exc: BaseException
                       ) -> tuple[Optional[dict[str, Any]], Optional[QuorumLostError]]:
    """After a blocked collective of a partition: the quorum protocol over the store (see
    :mod:`~robustagg.launch.quorum`). Returns ``(decision record, the error to raise if this side lost)``.

    Only a partition runs it in the workers: after a crash the launcher, which reaped the dead
    process and stops the others, decides (:func:`~robustagg.launch.quorum.next_epoch`).
    """
    cut = None if injector is None else injector.partition
    if membership is None or cut is None or not isinstance(exc, PartitionedError):
        return None, None
    ms, epoch = membership
    me = min(ids.values())
    step = cut.step
    members = ms.members(epoch)
    try:
        d = ms.decide(epoch, me, cut.reachable(members), step=step,
                      wait_s=max(1.0, min(10.0, float(job.settings.collective_timeout_s))))
    except QuorumLostError as lost:
        reached = cut.reachable(members)
        return {"epoch": epoch, "before": list(members), "reached": list(reached), "won": False, "step": step,
                "message": str(lost)}, lost
    return d.as_dict(), None


def _fp_hash(job: Job) -> str:
    from .identity import fingerprint_hash

    return fingerprint_hash(job.fingerprint)
