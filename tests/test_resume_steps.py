"""Extending a run on resume (``trainer.steps``) does what the README says (issue 28): allowed at a fixed
schedule length, refused (naming the key) when the schedule's length follows ``trainer.steps``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["logger=none", "trainer.progress=false", "trainer.mode=simulated", "trainer.eval_every=0", "threat.n=4",
         "threat.f=1", "trainer.checkpoint.every=2", "trainer.batch_size=8", "scheduler=cosine"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*SMALL, *overrides])


def test_a_cosine_run_whose_length_follows_the_steps_is_refused_when_extended(tmp_path):
    train(_cfg("trainer.steps=4"), out_dir=tmp_path / "run", quiet=True)
    with pytest.raises(ConfigError, match=r"scheduler\.T_max: 4 \(checkpoint\) -> 8 \(now\)"):
        train(_cfg("trainer.steps=8"), out_dir=tmp_path / "run", quiet=True)


def test_a_cosine_run_of_a_fixed_length_extends(tmp_path):
    first = train(_cfg("trainer.steps=4", "scheduler.T_max=8"), out_dir=tmp_path / "run", quiet=True)
    again = train(_cfg("trainer.steps=8", "scheduler.T_max=8"), out_dir=tmp_path / "run", quiet=True)
    assert first["steps"] == 4 and again["steps"] == 8 and again["resumed_from"]


def test_the_readme_says_which_step_changes_resume():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "`trainer.steps` may change, to extend a run, unless a schedule's length follows it" in text
    assert "`scheduler.T_max: 40 (checkpoint) -> 80 (now)`" in text and "`scheduler.T_max=80 trainer.steps=40`" in text
