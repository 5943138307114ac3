"""The two-rank example of docs (fault-tolerance design note), reproduced with the real machinery.

Two real gloo processes hold ``w = 1`` and apply the same aggregated gradient ``1`` with SGD, lr 0.2.
Rank 1 is SIGKILLed *between* the ranks' optimizer steps (after the reduction, before its own
optimizer step): rank 0 is at ``1 - 0.2 * 1 = 0.8``, rank 1 never moved.

1. Blind re-application: every rank re-applies the step from where it stands: rank 0 goes to
   ``0.8 - 0.2 = 0.6``, rank 1 to ``0.8``; the ranks now disagree, and the parameter-digest check
   says so.
2. Coordinated restore from the committed checkpoint (step 0) on both ranks: ``1 / 1``; replaying
   the step gives ``0.8 / 0.8``, bit for bit equal to an uninterrupted run.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import robustagg as ra
from robustagg.checkpoint import CheckpointStore, load_state, save_state
from robustagg.distributed import (GatherReduction, LocalComm, ProcessGroupComm, WorkerFailedError, destroy_group,
                                   free_port, init_group, spawn)
from robustagg.errors import DesyncError
from robustagg.training import Checkpointer, Fault, FaultInjector, Shard, Trainer, restore

LR = 0.2


def _trainer(comm, injector=None):
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shards = {r: Shard(torch.ones(4, 1), torch.zeros(4, dtype=torch.long)) for r in comm.local_ranks}
    # loss = mean over the batch of w * 1 = w, so every worker's gradient is exactly 1 (and so is the mean).
    return Trainer(model, opt, GatherReduction(ra.Mean(), comm), shards, batch_size=4, num_classes=1,
                   loss_fn=lambda logits, y: logits.mean(), metrics=False, injector=injector)


def _w(trainer) -> float:
    return float(trainer.model.weight.detach().reshape(-1)[0])  # a float32 value, exact as a Python float


def _phase(rank, port, phase, root):
    torch.set_num_threads(1)
    init_group(backend="gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20),
               init_method=f"tcp://127.0.0.1:{port}")
    root = Path(root)
    store = CheckpointStore(root / "ckpt")
    out: dict = {}
    try:
        comm = ProcessGroupComm(timeout_s=20.0)
        if phase == "fail":
            inj = FaultInjector([Fault("crash", rank=1, step=1, where="after_reduce")], worker_ids={rank: rank},
                                log=root / "ckpt" / "faults.jsonl", process_rank=rank)
            t = _trainer(comm, inj)
            Checkpointer(store, every=0).save(t)  # committed boundary: step 0, w = 1 on both ranks
            t.step()  # rank 1 dies after the reduction, before its optimizer step; rank 0 applies it
            try:
                t.check_parameters()
            except Exception as exc:  # the peer is gone: rank 0 keeps what it holds
                save_state(root / "survivor-0.pt", t.state_dict())
                out = {"w": _w(t), "error": type(exc).__name__}
        elif phase == "blind":
            t = _trainer(comm)
            if rank == 0:  # the survivor continues from what it holds (the step already applied)
                t.load_state_dict(load_state(root / "survivor-0.pt"))
            else:  # the restarted rank starts from the last state it committed
                ck, _ = store.latest()
                t.load_state_dict({"replicated": ck.load("replicated.pt"), "local": ck.load("rank-1.pt")})
            out["before"] = _w(t)
            t.apply(torch.ones(1))  # blind re-application of the failed step's aggregate
            out["w"] = _w(t)
            try:
                t.check_parameters()
            except DesyncError as exc:
                out["error"] = str(exc)
        else:  # coordinated restore, then replay
            t = _trainer(comm)
            got = restore(t, store, restart=1, reason="rank 1 killed between the optimizer steps", last_step=1)
            out["restored"] = {"step": got.step, "w": _w(t), "record": got.record}
            t.step()
            t.check_parameters()  # parameters and optimizer state agree
            out["w"] = _w(t)
        (root / f"{phase}-{rank}.json").write_text(json.dumps(out))
    finally:
        destroy_group()


def _run(phase, root):
    spawn(_phase, 2, args=(free_port(), phase, str(root)), start_method="fork", grace_seconds=1.0)
    return [json.loads((root / f"{phase}-{r}.json").read_text()) if (root / f"{phase}-{r}.json").exists() else None
            for r in range(2)]


def test_partial_application_blind_retry_diverges_restore_and_replay_agree(tmp_path):
    # Uninterrupted reference: the same step in one process (2 simulated workers).
    ref = _trainer(LocalComm(2))
    ref.step()
    w_ref = _w(ref)
    assert round(w_ref, 4) == 0.8  # 1 - 0.2 * 1

    # 1) partial application, then failure (a real SIGKILL between the ranks' optimizer steps)
    with pytest.raises(WorkerFailedError) as info:
        _run("fail", tmp_path)
    assert info.value.rank == 1 and info.value.error_type == "signal SIGKILL" and info.value.lost == [1]
    survivor = json.loads((tmp_path / "fail-0.json").read_text())
    assert survivor["w"] == w_ref and survivor["error"] == "CollectiveError"  # rank 0 applied; rank 1 never did

    # 2) blind re-application: [0.8, 1.0] -> [0.6, 0.8]; the digest check names the divergence
    blind = _run("blind", tmp_path)
    assert [round(b["before"], 4) for b in blind] == [0.8, 1.0]
    assert [round(b["w"], 4) for b in blind] == [0.6, 0.8]  # 0.8 - 0.2 and 1 - 0.2: diverged
    assert blind[0]["w"] != blind[1]["w"]
    assert all("ranks disagree on the parameter digest at step" in b["error"] for b in blind)

    # 3) coordinated restore to the committed step 0 on both ranks, then replay: equal, bit for bit
    good = _run("restore", tmp_path)
    assert [g["restored"]["step"] for g in good] == [0, 0] and [g["restored"]["w"] for g in good] == [1.0, 1.0]
    assert good[0]["w"] == good[1]["w"] == w_ref
    rec = good[0]["restored"]["record"]
    assert rec["restored_from"] == 0 and rec["steps_replayed"] == [1, 1] and rec["restart"] == 1
    assert [r["id"] for r in map(json.loads, (tmp_path / "ckpt" / "faults.jsonl").read_text().splitlines())] == [
        "crash@1:1"]
