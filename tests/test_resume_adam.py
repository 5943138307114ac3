"""SIGKILL and resume with Adam and the warm-up cosine schedule, with real processes.

A 4-process gloo run is killed in the middle of the warm-up, after the committed checkpoint of
step 4: the app's launcher restarts the group, every rank restores step 4 (Adam's first and
second moments and step counters, the schedule's position and its factor's parameters), replays
steps 5 and 6, and the run ends with parameters, optimizer and scheduler state ``torch.equal`` to
an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from experiments.train import train
from state_equal import assert_state_equal
from robustagg.checkpoint import load_state

CONF = Path(__file__).resolve().parents[1] / "conf"
STEPS, EVERY, N, WARMUP, CRASH_STEP, CRASH_RANK = 12, 4, 4, 6, 7, 2
COMMON = ["logger=none", "trainer.progress=false", f"threat.n={N}", "threat.f=1", "aggregator=centered_clipping",
          "aggregator.tau=0.5", "attack=mimic", "model.dropout=0.3", f"trainer.steps={STEPS}", "trainer.eval_every=4",
          "optimizer=adam", "optimizer.lr=0.01", "scheduler=warmup_cosine", f"scheduler.warmup_steps={WARMUP}",
          f"trainer.checkpoint.every={EVERY}", "trainer.param_check_every=3", "trainer.collective_timeout_s=30"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*COMMON, *overrides])


def _final(run: Path):
    return load_file(str(run / "model.safetensors")), load_state(run / "checkpoints" / f"step-{STEPS:08d}" /
                                                                 "replicated.pt")


@pytest.mark.slow
def test_sigkill_mid_warmup_with_adam_resumes_bit_for_bit(tmp_path):
    ref = train(_cfg(), out_dir=tmp_path / "ref", quiet=True)
    assert ref["restarts"] == 0
    s = train(_cfg("faults=[crash]", f"faults.crash.step={CRASH_STEP}", f"faults.crash.rank={CRASH_RANK}",
                   "trainer.max_restarts=1"), out_dir=tmp_path / "crash", quiet=True)
    assert s["restarts"] == 1 and s["steps"] == STEPS
    (rec,) = s["lineage"]
    assert rec["restored_from"] == EVERY and rec["steps_replayed"] == [EVERY + 1, CRASH_STEP - 1]
    assert "SIGKILL" in rec["reason"]
    wa, sa = _final(tmp_path / "crash")
    wb, sb = _final(tmp_path / "ref")
    assert_state_equal(wa, wb, "parameters")
    for key in ("model", "optimizer", "scheduler", "rule", "step", "last_digest"):
        assert_state_equal(sa[key], sb[key], key)
    for key in ("final_test_acc", "best_test_acc", "mean_kappa_hat", "byz_accepted_rate"):
        assert s[key] == ref[key], key
    adam = list(sa["optimizer"]["state"].values())
    assert adam and all(int(v["step"]) == STEPS and v["exp_avg_sq"].abs().sum() > 0 for v in adam)
    assert sa["scheduler"]["last_epoch"] == STEPS
    assert sa["scheduler"]["lr_lambdas"] == [{"warmup_steps": WARMUP, "total_steps": STEPS}]
