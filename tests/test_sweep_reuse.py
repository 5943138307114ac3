"""Runs that share a process (a warm joblib worker of a Hydra sweep) share nothing but what is pure.

The data set is read once per process (``experiments.data``'s source cache) and handed out
read-only; every run gets its own tensors. The slow test runs two different runs in one process in
both orders, each in a fresh interpreter, and asks for bit-identical results: the first run of a
process is a fresh run, so each run is compared with itself fresh and after the other one. Another
slow test runs a 4-job sweep over Hydra's joblib launcher with two workers and reads each job's
``job_timing.json`` (experiments.jobtiming): the workers are reused across jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import experiments.data as data_mod
from experiments.config import DataConf
from experiments.data import build_data, clear_source_cache
from real_files import write_mnist_files

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(DataConf), kw)


def _bundle_arrays(b):
    return [b.train_x.numpy().copy(), b.train_y.numpy().copy(), b.test_x.numpy().copy(), b.test_y.numpy().copy(),
            *[p.copy() for p in b.parts]]


def _same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def test_digits_are_read_once_per_process_and_shared_read_only(monkeypatch) -> None:
    clear_source_cache()
    calls = []
    real = data_mod.load_digits
    monkeypatch.setattr(data_mod, "load_digits", lambda: calls.append(1) or real())
    a = build_data(_cfg(), n=10, byzantine_ranks=[8, 9], seed=0)
    b = build_data(_cfg(partition="dirichlet", alpha=0.1), n=10, byzantine_ranks=[], seed=3)
    assert len(calls) == 1  # the second run, another partition and seed, reused the arrays
    x, y, classes, shape = data_mod._SOURCES[("digits",)]
    assert int(classes[0]) == 10 and shape.tolist() == [1, 8, 8]
    assert x.shape == (1797, 64) and y.shape == (1797,) and not x.flags.writeable and not y.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        x[0, 0] = 1.0
    for t in (a.train_x, a.train_y, a.test_x, a.test_y, b.train_x):  # each run owns writable tensors
        assert not np.shares_memory(t.numpy(), x) and not np.shares_memory(t.numpy(), y)
    clear_source_cache()
    assert _same(_bundle_arrays(a), _bundle_arrays(build_data(_cfg(), n=10, byzantine_ranks=[8, 9], seed=0)))
    assert len(calls) == 2  # cleared: read again


def test_a_run_that_changes_its_data_in_place_does_not_change_the_next_run() -> None:
    clear_source_cache()
    fresh = _bundle_arrays(build_data(_cfg(), n=5, byzantine_ranks=[], seed=1))
    first = build_data(_cfg(), n=5, byzantine_ranks=[], seed=1)
    for t in (first.train_x, first.train_y, first.test_x, first.test_y):
        t.zero_()
    assert _same(_bundle_arrays(build_data(_cfg(), n=5, byzantine_ranks=[], seed=1)), fresh)


def test_published_files_are_cached_by_folder_and_reread_when_they_change(tmp_path: Path) -> None:
    clear_source_cache()
    write_mnist_files(tmp_path, n_train=40, n_test=10, seed=0)
    cfg = _cfg(name="mnist", root=str(tmp_path))
    a = build_data(cfg, n=2, byzantine_ranks=[], seed=0)
    again = build_data(cfg, n=2, byzantine_ranks=[], seed=0)
    ref = _bundle_arrays(again)
    assert _same(_bundle_arrays(a), ref)
    assert sum(k[0] == "files" for k in data_mod._SOURCES) == 1
    a.test_x.zero_()  # the test split is the cached array, unindexed: each run must get a copy
    a.test_y.zero_()
    assert _same(_bundle_arrays(build_data(cfg, n=2, byzantine_ranks=[], seed=0)), ref)
    write_mnist_files(tmp_path, n_train=40, n_test=12, seed=1)  # other files, same folder
    changed = build_data(cfg, n=2, byzantine_ranks=[], seed=0)
    assert len(changed.test_y) == 12 and not torch.equal(changed.train_x[:5], again.train_x[:5])


#: Two runs in one interpreter, in the order given by argv[2:], each through experiments.train.train.
_TWO_RUNS = r"""
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")
from hydra import compose, initialize_config_dir
from experiments.train import train
runs = json.loads(sys.argv[1])
out = {}
for name in sys.argv[2:]:
    with initialize_config_dir(config_dir=runs["_conf"], version_base="1.3"):
        cfg = compose("config", overrides=runs[name])
    run_dir = runs["_out"] + "/" + name + "-" + "-".join(sys.argv[2:])
    s = train(cfg, out_dir=run_dir, quiet=True)
    model = hashlib.sha256(open(run_dir + "/model.safetensors", "rb").read()).hexdigest()
    metrics = [json.loads(l) for l in open(run_dir + "/metrics.jsonl") if l.strip()]
    keep = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in metrics]
    out[name] = {"model": model, "acc": s["final_test_acc"], "loss": s["final_test_loss"],
                 "kappa": s["mean_kappa_hat"], "metrics": hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()}
print("RUNS " + json.dumps(out))
"""


def _two_runs(order: list[str], runs: dict) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _TWO_RUNS, json.dumps(runs), *order], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RUNS "))
    return json.loads(line[len("RUNS "):])


@pytest.mark.slow
def test_two_runs_in_one_process_equal_the_same_runs_fresh_in_either_order(tmp_path: Path) -> None:
    common = ["+experiment=integrity_vs_suppression", "logger=none", "trainer.steps=12", "trainer.eval_every=6"]
    runs = {"_conf": str(ROOT / "conf"), "_out": str(tmp_path),
            # a Gram rule against an omniscient attack, iid; a coordinate rule against ALIE, Dirichlet
            "A": [*common, "+experiment/rule=krum", "attack=sign_flip", "data.partition=iid", "seed=0"],
            "B": [*common, "+experiment/rule=centered_clipping", "attack=alie", "data.partition=dirichlet", "seed=1"]}
    ab = _two_runs(["A", "B"], runs)  # A fresh, then B after A
    ba = _two_runs(["B", "A"], runs)  # B fresh, then A after B
    assert ab["A"] == ba["A"]
    assert ab["B"] == ba["B"]
    assert ab["A"]["model"] != ab["B"]["model"]  # two different runs (the comparison can fail)


@pytest.mark.slow
def test_joblib_sweep_reuses_its_worker_processes_and_records_each_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "experiments.train", "-m", "+experiment=integrity_vs_suppression", "logger=none",
           "trainer.steps=1", "trainer.eval_every=0", "+experiment/rule=mean", "attack=none,sign_flip",
           "data.partition=iid", "seed=0,1", "hydra/launcher=local", "hydra.launcher.n_jobs=2",
           f"hydra.sweep.dir={sweep}", "+hydra.callbacks.job_timing._target_=experiments.jobtiming.JobTiming"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    recs = [json.loads((sweep / str(k) / "job_timing.json").read_text()) for k in range(4)]
    assert sorted(r["job_num"] for r in recs) == [0, 1, 2, 3]
    assert all(r["status"] == "COMPLETED" and r["cpu_s"] > 0 and r["wall_s"] > 0 for r in recs)
    by_pid: dict[int, list[int]] = {}
    for r in recs:
        by_pid.setdefault(r["pid"], []).append(r["job_in_process"])
    assert len(by_pid) <= 2 and proc.pid not in by_pid  # two loky workers at most, none of them the launcher
    assert all(sorted(v) == list(range(1, len(v) + 1)) for v in by_pid.values())
    assert max(max(v) for v in by_pid.values()) >= 2  # four jobs, two workers: a worker ran a second job
