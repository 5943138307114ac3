"""Values that used to be accepted and broke the run later are refused before launch, in one line
(issue 27, item 10), by checks derived from one declaration per key (:mod:`robustagg.limits`).

The app (:func:`experiments.wiring.validate`, the command line) and a :class:`~robustagg.launch.Job`
built by hand refuse the same values: the ranges live on :class:`~robustagg.launch.RunSettings`'
fields and on the app schema's, the membership schedule is checked against n and the rule when the
Job is made.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import robustagg as ra
from experiments.config import DataConf, OptimizerLimits, ThreatConf
from experiments.wiring import SETTING_KEYS, validate
from robustagg.errors import AssumptionError, ConfigError
from robustagg.launch import Job, RunSettings, launch
from robustagg.limits import Limit, limit_of

CONF = Path(__file__).resolve().parents[1] / "conf"
BASE = ["logger=none", "trainer.steps=6", "threat.n=6", "threat.f=1", "aggregator=trimmed_mean", "attack=none"]
SIM = ["trainer.mode=simulated"]
REJOIN = ["faults=[rejoin]", "faults.rejoin.rank=5", "trainer.on_failure=shrink", "trainer.rejoin=true",
          "trainer.max_restarts=1", "trainer.checkpoint.every=1"]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*BASE, *overrides])


# (overrides, error, the message: the key, the value and the range or the fix)
REFUSED = [
    (["trainer.threads=1000000"], ConfigError,
     r"^trainer\.threads must be an integer in \[1, 256\] \(torch threads per process\); got 1000000\. "
     r"Use e\.g\. trainer\.threads=1\.$"),
    (["trainer.collective_timeout_s=1e-9"], ConfigError,
     r"^trainer\.collective_timeout_s must be a finite number in \[1, 86400\] .*; got 1e-09\. "
     r"Use e\.g\. trainer\.collective_timeout_s=60\.$"),
    ([*REJOIN, "faults.rejoin.join_step=2", "faults.rejoin.step=3"], ConfigError,
     r"join_step=2 is before the fault's step=3: .*use join_step >= 3, or join_step=0"),
    ([*SIM, "trainer.membership=[{workers:[5],absent:[2,5]},{workers:[4,5],absent:[3,6]}]"], ConfigError,
     r"^trainer\.membership\[1\] and trainer\.membership\[0\] both make worker\(s\) \[5\] absent at step 3"),
    ([*SIM, "trainer.membership=[{workers:[5],absent:[3.5,7]}]"], ConfigError,
     r"^trainer\.membership\[0\]: .*all whole numbers; got .*3\.5"),
    ([*SIM, "trainer.membership=[{workers:[5,5],absent:[3,5]}]"], ConfigError,
     r"^trainer\.membership\[0\]\.workers lists worker\(s\) \[5\] more than once"),
    ([*SIM, "aggregator=krum", "trainer.membership=[{workers:[4,5],absent:[3,5]}]"], AssumptionError,
     r"^trainer\.membership leaves 4 of the n=6 workers from step 3 on: Krum requires n >= 2f \+ 3 .*got n=4, f=1"),
    (["optimizer.momentum=1.5"], ConfigError,
     r"^optimizer\.momentum must be a finite number in \[0, 1\) \(the momentum beta, 0 = off\); got 1\.5\."),
    (["data.max_train_samples=-1"], ConfigError,
     r"^data\.max_train_samples must be an integer in \[1, inf\) or null .*; got -1\."),
    (["run_name=''"], ConfigError, r"^run_name='' is empty: give a plain folder name"),
    ([*REJOIN, "faults.rejoin.step=3", "faults.rejoin.join_step=6"], ConfigError,
     r"^fault rejoin: join_step=6 is not before the run's last step \(trainer\.steps=6\)"),
    (["threat.start_step=-1"], ConfigError, r"^threat\.start_step must be an integer in \[0, inf\)"),
]


@pytest.mark.parametrize("overrides,error,message", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_values_that_broke_the_run_later_are_refused_before_launch(overrides, error, message):
    with pytest.raises(error, match=message) as info:
        validate(_compose(overrides))
    assert "\n" not in str(info.value)  # one line


def test_the_library_refuses_the_same_values_as_the_app(tmp_path):
    # a Job built by hand: refused by launch before any process starts or any run file is written
    for kw in (dict(threads=1000000), dict(collective_timeout_s=1e-9), dict(worker_momentum=1.5)):
        key = next(iter(kw))
        app_key = SETTING_KEYS[key]
        lim = limit_of(RunSettings, key)
        assert lim is not None and lim.problem(app_key, kw[key])  # the declaration the app checks too
        job = Job(build=_never_built, n=3, run_dir=str(tmp_path / key), settings=RunSettings(mode="simulated", **kw))
        with pytest.raises(ConfigError, match=rf"^{key} must be a finite number|^{key} must be an integer"):
            launch(job, quiet=True)
        left = sorted(p.name for p in (tmp_path / key).iterdir()) if (tmp_path / key).exists() else []
        assert not set(left) & {"metrics.jsonl", "summary.json", "checkpoints", "evidence"}, left
    # the schedule is checked against the rule's requirement when the Job is made
    sched = [{"workers": [4, 5], "absent": [3, 5]}]
    with pytest.raises(AssumptionError, match=r"^membership leaves 4 of the n=6 workers from step 3 on: Krum"):
        Job(build=_never_built, n=6, run_dir=str(tmp_path / "k"), rule=ra.Krum(f=1),
            settings=RunSettings(mode="simulated", membership=sched))
    Job(build=_never_built, n=7, run_dir=str(tmp_path / "k"), rule=ra.Krum(f=1),  # 5 left: n >= 2f + 3 holds
        settings=RunSettings(mode="simulated", membership=sched))


def _never_built(ctx):  # pragma: no cover - a refused job never builds
    raise AssertionError("a refused job must not start")


def test_every_numeric_setting_declares_its_range():
    # one declaration per key (type, range, meaning): a new numeric key without one fails here
    exempt = {"seed", "n", "f", "byzantine"}  # seed: wiring._early_checks; n, f, byzantine: wiring._threat
    for schema in (RunSettings, DataConf, OptimizerLimits, ThreatConf):
        for f in dataclasses.fields(schema):
            numeric = f.type in ("int", "float", "Optional[int]", "Optional[float]")
            if numeric and f.name not in exempt:
                lim = limit_of(schema, f.name)
                assert isinstance(lim, Limit) and lim.meaning, f"{schema.__name__}.{f.name} declares no range"
                assert lim.holds(f.default), f"{schema.__name__}.{f.name}: the default is out of its own range"


def test_the_defaults_and_the_docs_settings_still_pass(tmp_path):
    plan = validate(_compose(["trainer.threads=2", "trainer.collective_timeout_s=1", "optimizer.momentum=0.9",
                              "data.max_train_samples=200", "run_name=ok", *REJOIN, "faults.rejoin.step=3",
                              "faults.rejoin.join_step=3"]))
    assert plan.cfg["trainer"]["threads"] == 2 and json.dumps(plan.cfg["faults"])
