"""SIGKILL and resume with Adam and the warm-up cosine schedule, with real processes.

A 4-process gloo run is killed in the middle of the warm-up, after the committed checkpoint of
step 4: the app's launcher restarts the group, every rank restores step 4 (Adam's first and
second moments and step counters, the schedule's position and its factor's parameters), replays
steps 5 and 6, and the run ends with parameters, optimizer and scheduler state ``torch.equal`` to
an uninterrupted run. The second test does the same through the library's launcher with
``precision=fp16`` (torch's CPU autocast): every worker's loss scaler comes back too.
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


# --- the library's launcher, fp16 with its loss scalers (torch's CPU autocast; the app refuses fp16 on CPU) ---
def _fp16_build(ctx):
    """Job.build: an MLP with dropout, Adam, the warm-up cosine schedule, the median; one Shard per worker id."""
    import robustagg as ra
    from robustagg.launch import WorkerParts
    from robustagg.training import Shard, WarmupCosine

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def data_of(wid):
        g = torch.Generator().manual_seed(100 + wid)
        return Shard(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))

    return WorkerParts(model=model, optimizer=opt, rule=ra.CoordinateWiseMedian(f=1), num_classes=3,
                       shards={r: ctx.shard(r, data_of) for r in ctx.local_ranks},
                       scheduler=WarmupCosine(opt, warmup_steps=WARMUP, total_steps=STEPS))


def _fp16_job(run: Path, faults=()):
    from robustagg.launch import Job, RunSettings

    settings = RunSettings(mode="processes", steps=STEPS, batch_size=8, precision="fp16", checkpoint_every=EVERY,
                           max_restarts=1 if faults else 0, collective_timeout_s=30.0)
    return Job(build=_fp16_build, n=3, run_dir=str(run), settings=settings, f=1, faults=list(faults))


@pytest.mark.slow
def test_sigkill_with_fp16_loss_scalers_resumes_bit_for_bit(tmp_path):
    # Adam, the warm-up cosine schedule and every worker's GradScaler (scale, growth tracker) come
    # back from the committed checkpoint of step 4 after worker 1 is SIGKILLed before step 7.
    from robustagg.launch import launch
    from robustagg.training import Fault

    ref = launch(_fp16_job(tmp_path / "ref"), quiet=True)
    s = launch(_fp16_job(tmp_path / "crash", [Fault(kind="crash", rank=1, step=CRASH_STEP)]), quiet=True)
    assert ref["restarts"] == 0 and s["restarts"] == 1 and s["lineage"][0]["restored_from"] == EVERY
    end = f"step-{STEPS:08d}"
    wa, wb = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("crash", "ref"))
    assert_state_equal(wa, wb, "parameters")
    ra_, rb = (load_state(tmp_path / d / "checkpoints" / end / "replicated.pt") for d in ("crash", "ref"))
    for key in ("model", "optimizer", "scheduler"):
        assert_state_equal(ra_[key], rb[key], key)
    for rank in range(3):
        la, lb = (load_state(tmp_path / d / "checkpoints" / end / f"rank-{rank}.pt") for d in ("crash", "ref"))
        sa, sb = la["workers"][rank]["scaler"], lb["workers"][rank]["scaler"]
        # 12 finite steps in a row (a fresh scaler after the restart would count 8)
        assert sa == sb and sa["_growth_tracker"] == STEPS and sa["scale"] == 2.0 ** 16, (rank, sa, sb)
