"""What every worker process runs: objects from the plan, restore, the training loop, the run files (rank 0).

Three ways in, one body (:func:`run_worker`):

- ``simulated``: :func:`run_simulated` hosts all n workers in this process (:class:`LocalComm`);
- ``processes`` (default): :func:`run_spawned` starts n processes (:func:`spawned_entry`), each
  joining a fresh gloo/NCCL group on a free localhost port, and *supervises* them: after a failure
  it records what the survivors saw and restarts the group (up to ``trainer.max_restarts``), with
  the same n or, under ``trainer.on_failure=shrink``, without the lost workers;
- under ``torchrun``: :func:`run_torchrun` joins the group torchrun set up (env://); torchrun's own
  ``--max-restarts`` restarts it, and the same restore logic runs.

Every start of the group restores the newest committed checkpoint every rank agrees on
(:func:`robustagg.training.restore`), and every failure leaves ``evidence/rank-<r>.json`` from each
surviving rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import instantiate

from robustagg.checkpoint import CheckpointStore, append_jsonl, read_jsonl
from robustagg.distributed import (Communicator, EnvRank, LocalComm, ProcessGroupComm, ShardedReduction, WorkerFailedError,
                                   destroy_group, free_port, init_group, make_reduction, raise_on_sigterm, spawn)
from robustagg.errors import AssumptionWarning
from robustagg.functional.gram import warm_up
from robustagg.training import (Checkpointer, FaultInjector, JsonlSink, Restored, StragglerLog, Trainer, evaluate, fit,
                                read_evidence, restore, save_model, seed_everything, write_evidence, write_json)
from robustagg.training.faults import fired_faults
from robustagg.training.resume import FAULT_LOG

from .recovery import (Attempt, last_step_reached, record_failure, shrink_plan, summary_from_records,
                       truncate_metrics)
from .wiring import Plan, build_byzantine, build_model_and_optimizer, build_rule

__all__ = ["run_worker", "run_simulated", "run_spawned", "spawned_entry", "run_torchrun", "Attempt"]

log = logging.getLogger(__name__)


def _device_for(plan: Plan, local_rank: int) -> torch.device:
    if plan.device == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _needs_store(plan: Plan) -> bool:
    tr = plan.cfg["trainer"]
    return bool(int(tr["checkpoint"]["every"]) > 0 or plan.faults or int(tr["max_restarts"]) > 0
                or str(tr["resume"]) not in ("auto", "never") or str(tr["on_failure"]) == "shrink"
                or Path(plan.ckpt_dir).is_dir())


def run_worker(plan: Plan, comm: Communicator, device: torch.device,
               attempt: Optional[Attempt] = None) -> Optional[dict[str, Any]]:
    """Build everything from ``plan``, restore, train, and (on rank 0) write the run files.

    Rank 0 writes ``metrics.jsonl`` (appended per record), ``summary.json`` and
    ``model.safetensors`` (temp file, fsync, rename) in ``plan.out_dir`` and logs to W&B when
    ``logger=wandb`` (``wandb.finish()`` in a ``finally``). On a failure every rank that is still
    alive writes ``evidence/rank-<r>.json`` before it re-raises.

    Returns:
        the summary dict on rank 0, ``None`` elsewhere.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)  # reported once, before launch
        return _run_worker(plan, comm, device, attempt or Attempt(resume=str(plan.cfg["trainer"]["resume"])))


def _run_worker(plan: Plan, comm: Communicator, device: torch.device, attempt: Attempt) -> Optional[dict[str, Any]]:
    cfg = plan.config()
    tr = cfg.trainer
    torch.set_num_threads(int(tr.threads))
    seed_everything(int(cfg.seed))
    warm_up()  # the Gram kernel's first-call cost must not land in a timed step or a collective
    model, optimizer, scheduler = build_model_and_optimizer(plan, cfg, device)
    rule = build_rule(cfg)
    reduction = make_reduction(str(tr.reduction), rule, comm, on_nonfinite=str(tr.on_nonfinite))
    if isinstance(reduction, ShardedReduction):
        reduction.metrics = bool(tr.metrics)  # its moments and shares cost collectives on every rank
    byzantine = build_byzantine(plan, cfg, rule)
    shards = {}
    for r in comm.local_ranks:
        s = plan.data.shard(r)
        s.x, s.y = s.x.to(device), s.y.to(device)
        shards[r] = s
    ids = {r: plan.identities[r] if plan.identities else r for r in comm.local_ranks}
    store = CheckpointStore(Path(plan.ckpt_dir), keep=int(tr.checkpoint.keep)) if _needs_store(plan) else None
    injector = None
    if plan.faults:
        injector = FaultInjector(plan.faults, worker_ids=ids, log=None if store is None else store.root / FAULT_LOG,
                                 process_rank=comm.rank, attempt=attempt.number)
    trainer = Trainer(model, optimizer, reduction, shards, batch_size=int(tr.batch_size),
                      num_classes=plan.data.num_classes, seed=int(cfg.seed), scheduler=scheduler,
                      worker_momentum=float(tr.worker_momentum), byzantine=byzantine, metrics=bool(tr.metrics),
                      identities=ids, injector=injector,
                      root=(plan.data.root(int(cfg.server.root_samples), int(cfg.seed)).to(device)
                            if int(cfg.server.root_samples) > 0 else None))
    comm.group_id = comm.group_id or f"{plan.run_id}/attempt-{attempt.number}"
    callbacks = [instantiate(c) for c in tr.callbacks]
    out = Path(plan.out_dir)
    main = comm.is_main
    sinks: list[Any] = []
    wandb_sink = None
    test_x, test_y = plan.data.test_x.to(device), plan.data.test_y.to(device)

    def eval_fn() -> dict[str, float]:
        return evaluate(model, test_x, test_y, plan.data.num_classes)

    def detect(rec: dict[str, Any]) -> None:
        append_jsonl(out / "detections.jsonl", {**rec, "attempt": attempt.number, "source": "in-run"})

    try:
        trainer.check_parameters()  # every rank starts from the same parameters
        restored = Restored()
        if store is not None:
            restored = restore(trainer, store, request=attempt.resume, fallback=attempt.fallback or None,
                               restart=attempt.number, reason=attempt.reason, last_step=attempt.last_step)
            if main and attempt.shrink is not None:
                store.append_lineage({**attempt.shrink, "step": restored.step, "restart": attempt.number})
        if main and (restored.checkpoint is not None or attempt.number > 0):
            truncate_metrics(out / "metrics.jsonl", restored.step)
        checkpointer = None
        if store is not None and int(tr.checkpoint.every) > 0:
            roles = {str(r): ("byzantine" if r in plan.byzantine_ranks else "honest") for r in range(plan.n)}
            meta = {"run_id": plan.run_id, "mode": str(tr.mode), "roles": roles, "config_hash": plan.config_hash,
                    "code_revision": plan.code_revision, "restart_count": attempt.number,
                    "identities": list(plan.identities)}
            checkpointer = Checkpointer(store, every=int(tr.checkpoint.every), meta=meta, injector=injector,
                                        parent=restored.checkpoint)
            if restored.checkpoint is not None and restored.step == trainer.step_id:
                checkpointer.last_saved = restored.step
        stragglers = StragglerLog(factor=float(tr.straggler_factor)) if main else None
        if main:
            sinks.append(JsonlSink(out / "metrics.jsonl"))
            if str(cfg.logger.name) == "wandb":
                from .sinks import WandbSink

                wandb_sink = WandbSink(cfg.logger, plan.cfg, str(out), name=f"{plan.rule_name}-{plan.attack_name}")
                sinks.append(wandb_sink)
        result = fit(trainer, steps=max(0, int(tr.steps) - trainer.step_id), evaluate=eval_fn if main else None,
                     eval_every=int(tr.eval_every), sinks=sinks, progress=bool(tr.progress),
                     param_check_every=int(tr.param_check_every), assumption_violated=plan.assumption_violated,
                     callbacks=callbacks, checkpointer=checkpointer, stragglers=stragglers, on_detect=detect)
        if not main:
            return None
        summary = result.to_dict()
        if restored.step > 0:
            summary_from_records(summary, read_jsonl(out / "metrics.jsonl"))
        summary["steps"] = trainer.step_id
        summary.update({"rule": plan.rule_name, "attack": plan.attack_name, "n": plan.n, "f": plan.f,
                        "byzantine": len(plan.byzantine_ranks), "byzantine_ranks": list(plan.byzantine_ranks),
                        "mode": str(tr.mode), "data": plan.data.name, "partition": plan.data.partition,
                        "seed": int(cfg.seed), "num_parameters": trainer.num_parameters(),
                        "worker_sizes": plan.data.sizes(), "label_skew": plan.data.label_skew(),
                        "violations": plan.violations, "run_dir": str(out), "run_id": plan.run_id,
                        "n_initial": plan.n_initial or plan.n, "workers": list(plan.identities),
                        "restarts": attempt.number, "resumed_from": restored.step if restored.checkpoint else None,
                        "lineage": [] if store is None else store.lineage(),
                        "faults": {"injected": fired_faults(None if store is None else store.root / FAULT_LOG),
                                   "detected": read_jsonl(out / "detections.jsonl")},
                        "straggler": stragglers.report() if stragglers is not None else {},
                        "checkpoint_dir": None if store is None else str(store.root)})
        save_model(model, out / "model.safetensors")
        write_json(out / "summary.json", summary)
        if wandb_sink is not None:
            wandb_sink.summary(summary)
        return summary
    except BaseException as exc:
        if wandb_sink is not None:
            wandb_sink.failed = True
        if not isinstance(exc, KeyboardInterrupt):
            try:
                write_evidence(out / "evidence", trainer, exc, attempt=attempt.number, run_id=plan.run_id)
            except Exception as ev_exc:  # evidence must never hide the failure
                log.warning("could not write evidence: %s", ev_exc)
        raise
    finally:
        for s in sinks:
            s.close()


def run_simulated(plan: Plan) -> dict[str, Any]:
    """All n workers in this process (no process group)."""
    device = _device_for(plan, 0)
    result = run_worker(plan, LocalComm(plan.n, device=device), device)
    assert result is not None
    return result


def spawned_entry(rank: int, plan: Plan, init_method: str, attempt: Optional[Attempt] = None) -> None:
    """Entry point of a spawned worker: join the group, train, leave the group."""
    cfg = plan.config()
    torch.set_num_threads(int(cfg.trainer.threads))
    timeout = float(cfg.trainer.collective_timeout_s)
    init_group(backend=plan.backend, rank=rank, world_size=plan.n, timeout=timedelta(seconds=timeout),
               init_method=init_method)
    try:
        device = _device_for(plan, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        number = 0 if attempt is None else attempt.number
        comm = ProcessGroupComm(device=device, timeout_s=timeout, group_id=f"{plan.run_id}/attempt-{number}")
        run_worker(plan, comm, device, attempt)
    finally:
        destroy_group()


def run_spawned(plan: Plan) -> dict[str, Any]:
    """Start n worker processes on this machine, supervise them, and return rank 0's summary.

    After a failure the supervisor appends a detection record built from the survivors' evidence
    to ``detections.jsonl``; if restarts are left (``trainer.max_restarts``) it archives the
    evidence to ``evidence/attempt-<k>/`` and starts the group again, which restores the newest
    committed checkpoint. With ``trainer.on_failure=shrink`` and workers lost, the new group has
    only the survivors, if the rule's requirement still holds for them.

    Raises:
        WorkerFailedError: a worker failed and no restart is left; the group was stopped (see
            :func:`robustagg.distributed.spawn`). The survivors' evidence is in ``evidence/``.
        AssumptionError: ``on_failure=shrink`` would break the rule's requirement.
    """
    cfg = plan.config()
    tr = cfg.trainer
    addr = str(tr.master_addr)
    method = str(tr.start_method)
    if method == "auto":
        method = "fork" if sys.platform.startswith("linux") and plan.device == "cpu" else "spawn"
    resume = str(tr.resume)
    explicit = resume if resume not in ("auto", "never") else ""
    attempt = Attempt(number=0, resume=resume)
    out = Path(plan.out_dir)
    warm_up()  # compile once here (forked workers inherit it, spawned ones load Numba's cache)
    while True:
        port = int(tr.port) or free_port(addr)
        try:
            spawn(spawned_entry, plan.n, args=(plan, f"tcp://{addr}:{port}", attempt), start_method=method,
                  preload=("torch", "torch._dynamo", "experiments.runner"))
            break
        except WorkerFailedError as exc:
            lost = [plan.identities[r] for r in exc.lost if r < len(plan.identities)]
            last = last_step_reached(out)
            more = attempt.number < int(tr.max_restarts)
            det = record_failure(out, attempt.number, lost=lost, message=str(exc), archive=more)
            if not more:
                if attempt.number:
                    raise WorkerFailedError(f"after {attempt.number} restart(s): {exc}", rank=exc.rank,
                                            error_type=exc.error_type, failures=exc.failures, lost=exc.lost,
                                            terminated=exc.terminated, exitcodes=exc.exitcodes) from None
                raise
            reason = (f"{det['kind']} detected at step {det['step']}: " if det.get("step") is not None
                      else f"{det['kind']}: ") + str(exc).splitlines()[0][:300]
            log.warning("restart %d/%d after %s", attempt.number + 1, int(tr.max_restarts), reason)
            shrink = None
            if str(tr.on_failure) == "shrink" and lost:
                try:
                    plan, shrink = shrink_plan(plan, lost, reason=reason)
                except Exception as refused:
                    CheckpointStore(Path(plan.ckpt_dir)).append_lineage(
                        {"event": "shrink_refused", "old_n": plan.n, "lost_workers": lost, "reason": str(refused)})
                    raise
            attempt = Attempt(number=attempt.number + 1, reason=reason, resume="auto", fallback=explicit,
                              last_step=last, shrink=shrink)
    return dict(json.loads((out / "summary.json").read_text()))


def run_torchrun(plan: Plan, env: EnvRank) -> Optional[dict[str, Any]]:
    """Join the group a launcher (torchrun) set up through the environment; rank 0 returns the summary.

    torchrun restarts the whole group after a failure (``--max-restarts``); a restarted worker sees
    ``TORCHELASTIC_RESTART_COUNT > 0``, and then restores the newest committed checkpoint (rank 0
    first records the previous attempt's evidence, as the app's own launcher does).
    """
    cfg = plan.config()
    torch.set_num_threads(int(cfg.trainer.threads))
    raise_on_sigterm()  # torchrun stops survivors with SIGTERM: let them write their evidence
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    plan.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or plan.run_id  # the same on every rank
    resume = str(cfg.trainer.resume)
    attempt = Attempt(number=restarts, resume=resume if restarts == 0 else "auto",
                      fallback=resume if resume not in ("auto", "never") else "")
    if restarts > 0 and env.rank == 0:
        out = Path(plan.out_dir)
        attempt.last_step = last_step_reached(out)
        seen = {int(e["rank"]) for e in read_evidence(out / "evidence")}
        lost = [plan.identities[r] for r in range(env.world_size) if r not in seen]  # no evidence: gone
        det = record_failure(out, restarts - 1, lost=lost, message="torchrun restarted the group", archive=True)
        attempt.reason = f"torchrun restart {restarts}: {det['kind']} detected at step {det['step']}: {det['message']}"
    timeout = float(cfg.trainer.collective_timeout_s)
    init_group(backend=plan.backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout))
    try:
        device = _device_for(plan, env.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = ProcessGroupComm(device=device, timeout_s=timeout,
                                group_id=f"{plan.run_id or 'torchrun'}/attempt-{restarts}")
        return run_worker(plan, comm, device, attempt)
    finally:
        destroy_group()
