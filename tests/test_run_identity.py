"""A run has an identity: resume compares the experiment's fingerprint before any process starts.

Reproduces issue 13, items 1, 4 and 5: against an n=4 checkpoint folder, changing n, lr, momentum,
seed, the partition, f, the scheduler, the rule, the attack or the model was silently mixed or
ignored (or failed inside the workers); ``n=5`` rejected every checkpoint and silently retrained
from step 0 on top of the old files. Now one message lists every differing key with both values
and the fix, and nothing is started or written; ``trainer.resume_changes=allow`` continues and
records the change in the lineage; ``trainer.steps`` may change (to extend a run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.checkpoint import read_jsonl
from robustagg.errors import ConfigError
from robustagg.launch import EXCLUDED, check_resume, fingerprint

CONF = Path(__file__).resolve().parents[1] / "conf"
BASE = ["logger=none", "trainer.progress=false", "trainer.mode=simulated", "threat.n=4", "threat.f=1",
        "aggregator=trimmed_mean", "attack=sign_flip", "trainer.steps=4", "trainer.checkpoint.every=2",
        "trainer.eval_every=0", "trainer.batch_size=16"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*BASE, *overrides])


@pytest.fixture(scope="module")
def n4_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("n4") / "run"
    train(_cfg(), out_dir=run, quiet=True)
    return run


@pytest.fixture()
def run(n4_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(n4_run, dest)
    return dest


def test_fingerprint_leaves_out_the_keys_that_do_not_change_the_trajectory():
    cfg = {"trainer": {"lr": 0.1, "steps": 5, "checkpoint": {"every": 2}, "progress": True}, "seed": 0,
           "logger": {"name": "wandb"}, "faults": {"crash": {"step": 1}}, "model": {"hidden": [64]}, "run_name": "x"}
    assert fingerprint(cfg) == {"model.hidden": [64], "seed": 0, "trainer.lr": 0.1}
    assert "trainer.steps" in EXCLUDED and "trainer.lr" not in EXCLUDED


@pytest.mark.slow
@pytest.mark.parametrize("override, key, old, new", [
    ("threat.n=3", "threat.n", 4, 3),
    ("threat.n=5", "threat.n", 4, 5),
    ("optimizer.lr=0.5", "optimizer.lr", 0.1, 0.5),
    ("optimizer.momentum=0.9", "optimizer.momentum", 0.0, 0.9),
    ("optimizer=adam", "optimizer._target_", "torch.optim.SGD", "torch.optim.Adam"),
    ("seed=1", "seed", 0, 1),
    ("data.partition=dirichlet", "data.partition", "iid", "dirichlet"),
    ("threat.f=0", "threat.f", 1, 0),
    ("scheduler=cosine", "scheduler._target_", None, "torch.optim.lr_scheduler.CosineAnnealingLR"),
    ("aggregator=coordinate_median", "aggregator._target_", "robustagg.CoordinateWiseTrimmedMean",
     "robustagg.CoordinateWiseMedian"),
    ("attack=ipm", "attack._target_", "attacks.SignFlip", "attacks.IPM"),
    ("model.hidden=[32]", "model.hidden", [64], [32]),
])
def test_resume_refuses_a_changed_experiment_before_anything_starts(run, override, key, old, new):
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(ConfigError) as err:
        train(_cfg(override), out_dir=run, quiet=True)
    msg = str(err.value)
    assert "belongs to a different experiment" in msg and f"{key}: {old!r} (checkpoint) -> {new!r} (now)" in msg
    assert "trainer.resume_changes=allow" in msg and "run_name" in msg
    after = sorted(p.name for p in run.rglob("*") if p.name != "lineage.jsonl")
    assert after == [p for p in before if p != "lineage.jsonl"]  # nothing written, nothing started


@pytest.mark.slow
def test_one_message_lists_every_differing_key(run):
    with pytest.raises(ConfigError) as err:
        train(_cfg("optimizer.lr=0.5", "seed=3", "threat.n=5"), out_dir=run, quiet=True)
    lines = [x.strip() for x in str(err.value).splitlines() if "(checkpoint) ->" in x]
    assert [x.split(":")[0] for x in lines] == ["optimizer.lr", "seed", "threat.n"]


@pytest.mark.slow
def test_extending_steps_is_the_same_experiment(run):
    s = train(_cfg("trainer.steps=6"), out_dir=run, quiet=True)
    assert s["resumed_from"] == 4 and s["steps"] == 6 and s["steps_this_run"] == 2
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_allowed_change_continues_and_is_recorded_in_the_lineage(run):
    s = train(_cfg("optimizer.lr=0.5", "trainer.steps=6", "trainer.resume_changes=allow"), out_dir=run, quiet=True)
    assert s["resumed_from"] == 4 and s["steps"] == 6
    (changed,) = [r for r in s["lineage"] if r["event"] == "experiment_changed"]
    assert changed["changes"] == {"optimizer.lr": [0.1, 0.5]} and changed["step"] == 4
    (restore,) = [r for r in s["lineage"] if r["event"] == "restore"]
    assert restore["experiment_changes"] == {"optimizer.lr": [0.1, 0.5]}


@pytest.mark.slow
def test_every_rejected_checkpoint_is_reported_and_the_run_refuses(run):
    for m in (run / "checkpoints").glob("step-*/manifest.json"):
        m.unlink()  # deleted manifests: nothing verifies any more
    with pytest.raises(ConfigError) as err:
        train(_cfg(), out_dir=run, quiet=True)
    msg = str(err.value)
    assert "none verifies" in msg and "step-00000004: no manifest" in msg and "step-00000002: no manifest" in msg
    assert "trainer.resume=never" in msg
    rejected = [r for r in read_jsonl(run / "checkpoints" / "lineage.jsonl") if r.get("event") == "rejected"]
    assert {r["checkpoint"] for r in rejected} == {"step-00000002", "step-00000004"}
    assert all("no manifest" in r["reason"] for r in rejected)


@pytest.mark.slow
def test_resume_never_starts_over_in_a_new_folder_and_keeps_the_old_one(run):
    old = sorted(p.name for p in (run / "checkpoints").iterdir())
    s = train(_cfg("seed=7", "trainer.resume=never"), out_dir=run, quiet=True)
    assert s["run_dir"] == str(run) + "-2" and s["resumed_from"] is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == old
    assert (Path(s["run_dir"]) / "checkpoints" / "step-00000004" / "manifest.json").is_file()


def test_check_resume_says_what_it_found(n4_run, tmp_path):
    fp = json.loads((n4_run / "checkpoints" / "step-00000004" / "manifest.json").read_text())["fingerprint"]
    found = check_resume(n4_run / "checkpoints", fp, record=False)
    assert (found.checkpoint, found.step, found.changes) == ("step-00000004", 4, {})
    assert found.message.startswith("resume: found step-00000004") and "(verified)" in found.message
    assert check_resume(tmp_path / "nothing", fp).message.startswith("resume: no checkpoint folder yet")
    bad = tmp_path / "bad"
    shutil.copytree(n4_run / "checkpoints", bad)
    (bad / "step-00000004" / "manifest.json").write_text("{not json")
    found = check_resume(bad, fp, record=False)
    assert found.checkpoint == "step-00000002" and found.rejected[0][0] == "step-00000004"


def test_a_checkpoint_older_than_a_new_key_resumes_when_the_key_keeps_its_default():
    # fingerprints written before the protocol seam, trainer.processes and trainer.precision existed
    from omegaconf import OmegaConf

    from robustagg.launch.identity import INTRODUCED, diff_fingerprints, fingerprint

    # trainer.batched_gradients=auto (the default) is resolved before the fingerprint is taken, and
    # on resuming an old checkpoint it resolves to its value, false (test_batched_gradients.py)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.batched_gradients=false"])
    new = fingerprint(OmegaConf.to_container(cfg, resolve=True))
    old = {k: v for k, v in new.items() if k not in INTRODUCED}
    assert set(INTRODUCED) <= set(new) and diff_fingerprints(old, new) == {}
    changed = {**new, "trainer.processes": 2, "protocol._target_": "robustagg.protocols.LocalRounds"}
    assert diff_fingerprints(old, changed) == {"trainer.processes": (0, 2),
                                               "protocol._target_": ("robustagg.protocols.DSGD",
                                                                     "robustagg.protocols.LocalRounds")}
