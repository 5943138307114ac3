"""Extending a run on resume (``trainer.steps``), as the README says (issue 28): a schedule whose length
follows ``trainer.steps`` (cosine's ``T_max``, warm-up cosine's ``total_steps``) follows it, so from the
checkpoint's step on the learning rate is the longer schedule's; a schedule of a fixed length is kept."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.checkpoint import load_state
from robustagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["logger=none", "trainer.progress=false", "trainer.mode=simulated", "trainer.eval_every=0", "threat.n=4",
         "threat.f=1", "trainer.checkpoint.every=2", "trainer.checkpoint.keep=10", "trainer.batch_size=8"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*SMALL, *overrides])


def _lr(run: Path, step: int) -> float:
    """The learning rate the optimizer holds after ``step`` steps (the one step ``step + 1`` uses)."""
    state = load_state(run / "checkpoints" / f"step-{step:08d}" / "replicated.pt")
    return float(state["optimizer"]["param_groups"][0]["lr"])


def test_a_cosine_run_extended_on_resume_follows_the_longer_schedule(tmp_path):
    run = tmp_path / "run"
    train(_cfg("scheduler=cosine", "trainer.steps=4"), out_dir=run, quiet=True)
    assert _lr(run, 4) == pytest.approx(0.0, abs=1e-12)  # the 4-step schedule ended at eta_min = 0
    again = train(_cfg("scheduler=cosine", "trainer.steps=8"), out_dir=run, quiet=True)
    assert again["steps"] == 8 and again["resumed_from"]
    for step in (6, 8):  # from the checkpoint on, the 8-step schedule: 0.1 * (1 + cos(pi * t / 8)) / 2
        assert _lr(run, step) == pytest.approx(0.05 * (1 + math.cos(math.pi * step / 8)), rel=1e-9, abs=1e-12)
    assert _lr(run, 6) > 0.01  # not stuck at the 4-step schedule's end


def test_a_warm_up_cosine_run_extended_on_resume_follows_too(tmp_path):
    run = tmp_path / "run"
    train(_cfg("scheduler=warmup_cosine", "scheduler.warmup_steps=2", "trainer.steps=4"), out_dir=run, quiet=True)
    train(_cfg("scheduler=warmup_cosine", "scheduler.warmup_steps=2", "trainer.steps=8"), out_dir=run, quiet=True)
    assert _lr(run, 6) == pytest.approx(0.05 * (1 + math.cos(math.pi * 4 / 6)), rel=1e-9)  # W=2, L=6, t=6


def test_a_schedule_of_a_fixed_length_is_kept_and_an_explicit_change_is_refused(tmp_path):
    run = tmp_path / "run"
    train(_cfg("scheduler=cosine", "scheduler.T_max=8", "trainer.steps=4"), out_dir=run, quiet=True)
    train(_cfg("scheduler=cosine", "scheduler.T_max=8", "trainer.steps=6"), out_dir=run, quiet=True)
    assert _lr(run, 6) == pytest.approx(0.05 * (1 + math.cos(math.pi * 6 / 8)), rel=1e-9)
    with pytest.raises(ConfigError, match=r"scheduler\.T_max: 8 \(checkpoint\) -> 12 \(now\)"):
        train(_cfg("scheduler=cosine", "scheduler.T_max=12", "trainer.steps=8"), out_dir=run, quiet=True)


def test_the_readme_says_a_schedule_that_follows_the_steps_follows_on_resume():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "`trainer.steps` may change, to extend a run" in text
    assert "a schedule whose length follows `trainer.steps`" in text


def test_a_plain_restore_is_load_state_dict_and_an_older_checkpoint_still_matches():
    import torch

    from robustagg.launch.identity import FOLLOWS_STEPS, diff_fingerprints
    from robustagg.training.schedules import restore_schedule

    def cosine(t_max):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)

    opt, sched = cosine(8)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved = opt.state_dict(), sched.state_dict()
    opt2, same = cosine(8)
    opt2.load_state_dict(saved_opt)
    assert restore_schedule(same, saved) == [] and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    opt3, longer = cosine(16)
    opt3.load_state_dict(saved_opt)
    assert restore_schedule(longer, saved) == ["T_max"] and longer.T_max == 16
    assert opt3.param_groups[0]["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi * 3 / 16)), rel=1e-12)
    # a checkpoint written before the marker recorded the length it had: the same experiment
    assert diff_fingerprints({"scheduler.T_max": 40}, {"scheduler.T_max": FOLLOWS_STEPS}) == {}
    assert diff_fingerprints({"scheduler.T_max": FOLLOWS_STEPS}, {"scheduler.T_max": 80}) != {}
