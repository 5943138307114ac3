"""Every bad value gets one line with the key, the value and the valid type or options; a setting that
silently does nothing is warned about once; suggestions name only keys that exist (issue 28, "Bad values")."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from hydra import compose, initialize_config_dir

from experiments.config import TrainConfig, _setting_paths, check_command_line
from experiments.train import train
from experiments.value_types import check_tree_types
from experiments.wiring import as_config, validate
from robustagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.mode=simulated", "trainer.steps=2", "trainer.eval_every=0"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


@pytest.mark.parametrize("override, pattern", [
    ("threat.n=six", r"^threat\.n=six: threat\.n takes an integer; got the string 'six'\. Use e\.g\. threat\.n=10\.$"),
    ("trainer.mode=simulate", r"^trainer\.mode=simulate: trainer\.mode takes one of processes, simulated \(did you "
                              r"mean simulated\?\); got the string 'simulate'\."),
    ("threat.n=4,six", r"^threat\.n=six: threat\.n takes an integer"),  # each value of a sweep
    ("data.partition=dirichlt", r"takes one of iid, dirichlet, label_sorted, long_tail, natural \(did you mean "
                                r"dirichlet\?\)"),
    ("trainer.metrics=maybe", r"^trainer\.metrics=maybe: trainer\.metrics takes true or false"),
])
def test_a_value_of_the_wrong_type_on_the_command_line_is_one_line(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        check_command_line([override])
    assert "\n" not in str(err.value)


def test_group_choices_and_hydras_own_options_pass_the_command_line_checks():
    check_command_line(["faults=[crash]", "hydra/launcher=basic", "trainer.steps=5", "seed=0,1", "data.root=null"])
    with pytest.raises(ConfigError, match=r"no option 'basik' \(did you mean basic\?\)"):
        check_command_line(["hydra/launcher=basik"])


def test_the_app_prints_one_line_for_a_wrong_type_before_hydra_composes():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-m", "experiments.train", "threat.n=six", "logger=none"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["error: threat.n=six: threat.n takes an integer; got the string 'six'. "
                                               "Use e.g. threat.n=10."]


def test_a_parameter_of_a_target_node_is_checked_against_the_class_signature(tmp_path):
    with pytest.raises(ConfigError, match=r"^optimizer\.lr=fast: optimizer\.lr \(torch\.optim\.SGD's parameter\) takes "
                                          r"a number; got the string 'fast'\.") as err:
        train(_cfg("optimizer.lr=fast"), out_dir=tmp_path / "run", quiet=True)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"^aggregator\.f=two: aggregator\.f \(robustagg\.CoordinateWiseTrimmedMean's "
                                          r"parameter\) takes an integer"):
        validate(_cfg("aggregator.f=two"))


def test_a_config_tree_gets_the_same_line_as_the_command_line():
    with pytest.raises(ConfigError, match=r"^threat\.n=six: threat\.n takes an integer; got the string 'six'"):
        as_config({"threat": {"n": "six"}, "aggregator": {"_target_": "robustagg.Mean"}})


@dataclasses.dataclass
class Inner:
    rate: float = 0.5
    name: Optional[str] = None


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    count: int = 3


def test_the_type_check_reads_the_schema_not_a_list():
    # dataclasses the check has never seen: their fields' annotations are the whole specification
    check_tree_types({"inner": {"rate": "1e-3", "name": None}, "count": 4}, Outer)
    with pytest.raises(ConfigError, match=r"^inner\.rate=quick: inner\.rate takes a number; got the string 'quick'\. "
                                          r"Use e\.g\. inner\.rate=0\.5\.$"):
        check_tree_types({"inner": {"rate": "quick"}}, Outer)


def test_suggestions_name_only_keys_that_exist():
    with pytest.raises(ConfigError) as err:
        check_command_line(["trainer.step=5"])
    text = str(err.value)
    assert "did you mean trainer.steps?" in text and "nesterov" not in text
    named = [w.strip("?,.()'") for w in text.split("did you mean", 1)[1].split("(")[0].split()]
    settings = set(_setting_paths(TrainConfig))
    assert [w for w in named if w.startswith("trainer.")] and all(w in settings for w in named if "." in w)
    with pytest.raises(ConfigError, match=r"trainer\.nesterov=True -> optimizer\.nesterov"):
        validate(_cfg("trainer.nesterov=true"))  # a moved key still gets its migration message


@pytest.mark.parametrize("overrides, typed, line", [
    (["attack=alie", "threat.f=0"], (), r"^attack ALIE has no Byzantine worker to run it \(threat\.byzantine=0, which "
                                        r"follows threat\.f=0\)"),
    (["model=resnet20"], (), r"^model ResNet20 is built for 32x32 images .* these inputs are 1x8x8, so its last "
                             r"stage sees 2x2 maps"),
    (["data.shards_per_worker=100"], ("data.shards_per_worker",),
     r"^data\.shards_per_worker=100 does nothing under data\.partition=iid \(only data\.partition=label_sorted "
     r"reads it\)"),
    (["data.partition=label_sorted", "data.shards_per_worker=100"], (),
     r"^data\.shards_per_worker=100 is at least the 10 classes"),
    (["scheduler=warmup_cosine", "trainer.steps=20"], (),
     r"^scheduler\.warmup_steps=50 is not shorter than the run \(scheduler\.total_steps=20"),
])
def test_a_setting_that_silently_does_nothing_is_warned_about_once(overrides, typed, line, monkeypatch):
    import experiments.wiring as wiring

    monkeypatch.setattr(wiring, "_command_line_keys", lambda: set(typed))  # what the user typed (Hydra's task)
    plan = validate(_cfg(*overrides))
    matching = [n for n in plan.notes if __import__("re").search(line, n)]
    assert len(matching) == 1, plan.notes
    assert all("\n" not in n for n in plan.notes)


def test_a_plain_run_gets_no_such_warning(monkeypatch):
    import experiments.wiring as wiring

    monkeypatch.setattr(wiring, "_command_line_keys", lambda: {"data.alpha"})
    assert validate(_cfg("data.partition=dirichlet", "data.alpha=0.1")).notes == []
