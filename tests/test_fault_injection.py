"""Fault injection itself: the fault specs, firing once per run, determinism, configuration checks, and
the launcher naming a SIGKILLed worker (not the peers that only saw its connection close) as root cause."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.wiring import validate
from robustagg.distributed import (ProcessGroupComm, WorkerFailedError, destroy_group, free_port, init_group, spawn)
from robustagg.errors import ConfigError
from robustagg.training import Fault, FaultInjector

CONF = Path(__file__).resolve().parents[1] / "conf"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.steps=10", *overrides])


@pytest.mark.parametrize("kw,message", [
    (dict(kind="melt"), r"^unknown fault kind 'melt'; choose one of crash, hang, desync, corrupt, nan, "),
    (dict(kind="crashh"), r"^unknown fault kind 'crashh' \(did you mean crash\?\); choose one of crash, hang, "),
    (dict(kind="crash", where="after_stp"), r"where must be one of .*; got 'after_stp' \(did you mean after_step"),
    (dict(kind="hang", seconds=float("inf")), "seconds must be > 0 and finite; got inf"),
    (dict(kind="crash", step=0), "step must be >= 1"),
    (dict(kind="crash", where="sometime"), "where must be one of before_step, after_reduce, after_step"),
    (dict(kind="hang", seconds=0), "seconds must be > 0"),
    (dict(kind="desync", mode="swap"), "mode must be skip or reorder"),
    (dict(kind="checkpoint_crash", rank=2, phase="commit"), "phase=commit happens on rank 0"),
])
def test_bad_fault_specs_are_refused_with_the_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        Fault(**kw)


def test_each_fault_fires_once_per_run_across_restarts(tmp_path):
    log = tmp_path / "faults.jsonl"
    faults = [Fault("nan", rank=1, step=3), Fault("corrupt", rank=0, step=2, bits=4)]
    inj = FaultInjector(faults, worker_ids={0: 0, 1: 1}, log=log)
    g = torch.ones(5)
    assert torch.equal(inj.submission(1, 1, g), g)  # step id 1 is step 2: not yet
    bad = inj.submission(2, 1, g)
    assert int(bad.isnan().sum()) == 1 and torch.equal(g, torch.ones(5))  # a copy; the input is untouched
    assert torch.equal(inj.submission(2, 1, g), g)  # fired once
    frame = torch.zeros(24, dtype=torch.uint8)
    flipped = inj.tamper(1, 0, frame)
    bits = int(sum(bin(int(b)).count("1") for b in flipped))
    assert 1 <= bits <= 4 and not flipped[-8:].any()  # body bits only; the checksum trailer is intact
    # a new injector after a restart reads the log: the replayed steps fire nothing
    again = FaultInjector(faults, worker_ids={0: 0, 1: 1}, log=log, attempt=1)
    assert again.fired == {"nan@1:3", "corrupt@0:2"}
    assert torch.equal(again.submission(2, 1, g), g) and torch.equal(again.tamper(1, 0, frame), frame)
    # deterministic in (rank, step): a fresh run flips the same bits
    fresh = FaultInjector(faults, worker_ids={0: 0, 1: 1})
    assert torch.equal(fresh.tamper(1, 0, frame), flipped)


def test_faults_hit_worker_ids_not_ranks():
    # after a shrink worker 6 runs as rank 5: a fault on worker 6 follows it, a fault on worker 5 is gone
    inj = FaultInjector([Fault("nan", rank=6, step=1), Fault("nan", rank=5, step=1, name="lost")],
                        worker_ids={5: 6})
    assert int(inj.submission(0, 5, torch.ones(3)).isnan().sum()) == 1 and inj.fired == {"nan@6:1"}
    with pytest.raises(ConfigError, match="fault ids must be unique"):
        FaultInjector([Fault("nan", rank=1, step=1), Fault("nan", rank=1, step=1)], worker_ids={0: 0})


@pytest.mark.parametrize("overrides,message", [
    (["faults=[crash]", "faults.crash.rank=12"], "faults.crash: rank 12 does not exist among n=10 workers"),
    (["faults=[crash]", "faults.crash.step=11"], r"step 11 is after the last step \(trainer.steps=10\)"),
    (["faults=[checkpoint_corrupt]", "trainer.checkpoint.every=4", "faults.checkpoint_corrupt.step=6"],
     "no checkpoint is written at step 6"),
    (["faults=[checkpoint_crash]"], "no checkpoint is written at step 8"),
    (["faults=[crash]", "trainer.mode=simulated"], "fault injection needs trainer.mode=processes"),
    (["trainer.on_failure=shrink", "trainer.mode=simulated"], "on_failure=shrink needs the app's own launcher"),
    (["+faults.x={kind: crash, rnk: 1}"], r"unknown key faults\.x\.rnk: the schema of faults\.x \(FaultConf\) .*Did "
                                          r"you mean faults\.x\.rank\?"),
    (["trainer.on_failure=retry"], "trainer.on_failure must be restart or shrink"),
])
def test_fault_configuration_is_checked_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides))


def test_config_group_selects_several_faults():
    plan = validate(_cfg("faults=[crash,desync,nonfinite]", "faults.crash.step=7"))
    assert [(f.id, f.kind, f.step) for f in plan.faults] == [("crash", "crash", 7), ("desync", "desync", 3),
                                                             ("nonfinite", "nan", 3)]


def _killed(rank, port, how):
    torch.set_num_threads(1)
    init_group(backend="gloo", rank=rank, world_size=4, timeout=timedelta(seconds=20),
               init_method=f"tcp://127.0.0.1:{port}")
    try:
        comm = ProcessGroupComm(timeout_s=20.0)
        for step in range(5):
            if rank == 2 and step == 2:
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(71)
            comm.all_gather({rank: torch.ones(3)})
    finally:
        destroy_group()


@pytest.mark.parametrize("how,what", [("sigkill", "signal SIGKILL"), ("exit", "exit code 71")])
def test_the_killed_rank_is_the_root_cause_not_its_peers(how, what):
    with pytest.raises(WorkerFailedError, match=rf"worker rank 2 died \({what}\) without raising") as info:
        spawn(_killed, 4, args=(free_port(), how), start_method="fork", grace_seconds=1.0)
    err = info.value
    assert err.rank == 2 and err.error_type == what and err.lost == [2] and err.terminated == []
    assert sorted(f["rank"] for f in err.failures) == [0, 1, 3]
    assert all(f["type"] == "CollectiveError" for f in err.failures)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "faults").glob("*.yaml")))
def test_every_fault_config_file_composes_and_validates(option):
    extra = {"partition": ["trainer.on_failure=shrink", "threat.n=6"],  # a cut needs a quorum
             "rejoin": ["trainer.on_failure=shrink", "trainer.rejoin=true", "threat.n=6"]}.get(option, [])
    plan = validate(_cfg(f"faults=[{option}]", "trainer.checkpoint.every=4", "trainer.reduction=gather", *extra))
    assert len(plan.faults) == (0 if option == "none" else 1)
    assert all(f.id == option for f in plan.faults)
