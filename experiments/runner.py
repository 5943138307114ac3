"""What every worker process runs: objects from the plan, the training loop, the run files (rank 0).

Three ways in, one body (:func:`run_worker`):

- ``simulated``: :func:`run_simulated` hosts all n workers in this process (:class:`LocalComm`);
- ``processes`` (default): :func:`run_spawned` starts n processes (:func:`spawned_entry`), each
  joining a fresh gloo/NCCL group on a free localhost port;
- under ``torchrun``: :func:`run_torchrun` joins the group torchrun set up (env://).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import instantiate

from robustagg.distributed import (Communicator, EnvRank, LocalComm, ProcessGroupComm, destroy_group, free_port,
                                   init_group, make_reduction, spawn)
from robustagg.errors import AssumptionWarning
from robustagg.training import JsonlSink, Trainer, evaluate, fit, save_model, seed_everything, write_json

from .wiring import Plan, build_byzantine, build_model_and_optimizer, build_rule

__all__ = ["run_worker", "run_simulated", "run_spawned", "spawned_entry", "run_torchrun"]

log = logging.getLogger(__name__)


def _device_for(plan: Plan, local_rank: int) -> torch.device:
    if plan.device == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def run_worker(plan: Plan, comm: Communicator, device: torch.device) -> Optional[dict[str, Any]]:
    """Build everything from ``plan``, train, and (on rank 0) write the run files.

    Rank 0 writes ``metrics.jsonl`` (appended per record), ``summary.json`` and
    ``model.safetensors`` (temp file, fsync, rename) in ``plan.out_dir`` and logs to W&B when
    ``logger=wandb`` (``wandb.finish()`` in a ``finally``).

    Returns:
        the summary dict on rank 0, ``None`` elsewhere.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)  # reported once, before launch
        return _run_worker(plan, comm, device)


def _run_worker(plan: Plan, comm: Communicator, device: torch.device) -> Optional[dict[str, Any]]:
    cfg = plan.config()
    torch.set_num_threads(int(cfg.trainer.threads))
    seed_everything(int(cfg.seed))
    model, optimizer, scheduler = build_model_and_optimizer(plan, cfg, device)
    rule = build_rule(cfg)
    reduction = make_reduction(str(cfg.trainer.reduction), rule, comm, on_nonfinite=str(cfg.trainer.on_nonfinite))
    byzantine = build_byzantine(plan, cfg, rule)
    shards = {}
    for r in comm.local_ranks:
        s = plan.data.shard(r)
        s.x, s.y = s.x.to(device), s.y.to(device)
        shards[r] = s
    trainer = Trainer(model, optimizer, reduction, shards, batch_size=int(cfg.trainer.batch_size),
                      num_classes=plan.data.num_classes, seed=int(cfg.seed), scheduler=scheduler,
                      worker_momentum=float(cfg.trainer.worker_momentum), byzantine=byzantine,
                      metrics=bool(cfg.trainer.metrics))
    callbacks = [instantiate(c) for c in cfg.trainer.callbacks]
    trainer.check_parameters()  # every rank starts from the same parameters
    out = Path(plan.out_dir)
    main = comm.is_main
    sinks: list[Any] = []
    wandb_sink = None
    test_x, test_y = plan.data.test_x.to(device), plan.data.test_y.to(device)

    def eval_fn() -> dict[str, float]:
        return evaluate(model, test_x, test_y, plan.data.num_classes)

    try:
        if main:
            sinks.append(JsonlSink(out / "metrics.jsonl"))
            if str(cfg.logger.name) == "wandb":
                from .sinks import WandbSink

                wandb_sink = WandbSink(cfg.logger, plan.cfg, str(out), name=f"{plan.rule_name}-{plan.attack_name}")
                sinks.append(wandb_sink)
        result = fit(trainer, steps=int(cfg.trainer.steps), evaluate=eval_fn if main else None,
                     eval_every=int(cfg.trainer.eval_every), sinks=sinks, progress=bool(cfg.trainer.progress),
                     param_check_every=int(cfg.trainer.param_check_every),
                     assumption_violated=plan.assumption_violated, callbacks=callbacks)
        if not main:
            return None
        summary = result.to_dict()
        summary.update({"rule": plan.rule_name, "attack": plan.attack_name, "n": plan.n, "f": plan.f,
                        "byzantine": len(plan.byzantine_ranks), "byzantine_ranks": list(plan.byzantine_ranks),
                        "mode": str(cfg.trainer.mode), "data": plan.data.name, "partition": plan.data.partition,
                        "seed": int(cfg.seed), "num_parameters": trainer.num_parameters(),
                        "worker_sizes": plan.data.sizes(), "label_skew": plan.data.label_skew(),
                        "violations": plan.violations, "run_dir": str(out)})
        save_model(model, out / "model.safetensors")
        write_json(out / "summary.json", summary)
        if wandb_sink is not None:
            wandb_sink.summary(summary)
        return summary
    except BaseException:
        if wandb_sink is not None:
            wandb_sink.failed = True
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


def spawned_entry(rank: int, plan: Plan, init_method: str) -> None:
    """Entry point of a spawned worker: join the group, train, leave the group."""
    cfg = plan.config()
    torch.set_num_threads(int(cfg.trainer.threads))
    init_group(backend=plan.backend, rank=rank, world_size=plan.n,
               timeout=timedelta(seconds=float(cfg.trainer.collective_timeout_s)), init_method=init_method)
    try:
        device = _device_for(plan, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        run_worker(plan, ProcessGroupComm(device=device), device)
    finally:
        destroy_group()


def run_spawned(plan: Plan) -> dict[str, Any]:
    """Start n worker processes on this machine and wait; returns rank 0's summary.

    Raises:
        WorkerFailedError: a worker failed; the group was stopped (see
            :func:`robustagg.distributed.spawn`).
    """
    cfg = plan.config()
    addr = str(cfg.trainer.master_addr)
    port = int(cfg.trainer.port) or free_port(addr)
    method = str(cfg.trainer.start_method)
    if method == "auto":
        method = "fork" if sys.platform.startswith("linux") and plan.device == "cpu" else "spawn"
    spawn(spawned_entry, plan.n, args=(plan, f"tcp://{addr}:{port}"), start_method=method,
          preload=("torch", "torch._dynamo", "experiments.runner"))
    return dict(json.loads((Path(plan.out_dir) / "summary.json").read_text()))


def run_torchrun(plan: Plan, env: EnvRank) -> Optional[dict[str, Any]]:
    """Join the group a launcher (torchrun) set up through the environment; rank 0 returns the summary."""
    cfg = plan.config()
    torch.set_num_threads(int(cfg.trainer.threads))
    init_group(backend=plan.backend, rank=env.rank, world_size=env.world_size,
               timeout=timedelta(seconds=float(cfg.trainer.collective_timeout_s)))
    try:
        device = _device_for(plan, env.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return run_worker(plan, ProcessGroupComm(device=device), device)
    finally:
        destroy_group()
