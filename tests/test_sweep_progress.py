"""Sweeps say how far they are, and W&B runs say what they are (issue 28, "Sweeps and W&B").

- one line per finished job (``k of N done``), one summary at the end (done / failed / skipped,
  wall time, the report command), and no 25-line table per job;
- run names, W&B tags and groups with rule, attack, partition and seed;
- only the chosen data set's keys in the logged config;
- W&B's start-up off the training's critical path;
- a report that says why a column is empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

os.environ.setdefault("WANDB_MODE", "disabled")

import experiments.config  # noqa: E402,F401
from experiments import sweep_progress as sp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# --- progress and summary ------------------------------------------------------------------------
def test_progress_counts_every_finished_job_and_the_summary_names_the_report(tmp_path: Path) -> None:
    sp.start(tmp_path, jobs=3)
    assert sp.finish_job(tmp_path, 0, "ok", "mean vs none, iid, seed 0: final acc 0.912") == \
        "[1 of 3 done] #0 mean vs none, iid, seed 0: final acc 0.912"
    assert sp.finish_job(tmp_path, 2, "skipped", "bulyan vs none: Bulyan requires n >= 4f + 3").startswith("[2 of 3 done]")
    assert sp.finish_job(tmp_path, 1, "failed", "krum vs alie: RuntimeError: boom").startswith("[3 of 3 done] #1")
    assert sp.complete(tmp_path)
    text = sp.summary(tmp_path)
    assert "1 done, 1 failed, 1 skipped (of 3 jobs)" in text
    assert f"python -m experiments.report {tmp_path}" in text and "wall time" in text
    # a job that finishes twice (a re-run of the sweep folder) is counted once, its last status wins
    sp.finish_job(tmp_path, 1, "ok", "krum vs alie: final acc 0.8")
    assert "2 done, 0 failed, 1 skipped (of 3 jobs)" in sp.summary(tmp_path)


def test_a_job_that_exits_on_a_bad_value_is_counted_as_failed(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "-m", "+experiment=integrity_vs_suppression_quick",
                           "+experiment/rule=mean", "attack=none", "data.partition=iid", "optimizer.lr=-1",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "[1 of 1 done] #0 failed: ConfigError: optimizer.lr must be" in out
    assert "0 done, 1 failed, 0 skipped (of 1 jobs)" in out


def test_sweep_size_is_the_launched_job_count() -> None:
    params = {"+experiment/rule": "mean,krum", "attack": "none,alie,ipm", "seed": "0"}
    assert sp.count_jobs(params, ["data.partition=iid,dirichlet", "trainer.steps=3"]) == 2 * 3 * 2
    assert sp.count_jobs(params, ["attack=none"]) == 2  # the command line replaces the experiment's list


@pytest.mark.slow
def test_a_sweep_prints_one_line_per_job_and_a_summary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "-m", "+experiment=integrity_vs_suppression_quick",
                           "+experiment/rule=mean,bulyan", "attack=none,sign_flip", "data.partition=iid",
                           "trainer.steps=2", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for k in range(1, 5):
        assert f"[{k} of 4 done]" in out, out[-4000:]
    assert "2 done, 0 failed, 2 skipped (of 4 jobs)" in out and out.count("sweep finished:") == 1
    assert f"python -m experiments.report {sweep}" in out
    assert "┏" not in out and "summary: {" not in out  # no per-job table, no dict dump
    assert out.count("Bulyan requires") == 2  # once per skipped job, not twice


# --- names, tags, groups, logged config ----------------------------------------------------------
def test_run_name_tags_and_group_carry_rule_attack_partition_and_seed(tmp_path: Path) -> None:
    from experiments.wiring import validate

    plan = validate(_compose("trainer.mode=simulated", "data.partition=dirichlet", "data.alpha=0.3", "seed=3",
                             "logger.tags=[mine]", "logger.group=g1"), out_dir=str(tmp_path))
    job = plan.job()
    assert job.name == "trimmed_mean-alie-dirichlet(a=0.3)-seed3"  # it was "trimmed_mean-alie" for every run
    tags = job.settings.logger["tags"]
    assert tags[0] == "mine" and {"rule:trimmed_mean", "attack:alie", "partition:dirichlet(a=0.3)", "seed:3"} <= set(tags)
    assert job.settings.logger["group"] == "g1"
    assert all(len(t) <= 64 for t in tags)  # W&B's limit on a tag


def test_logged_config_holds_only_the_chosen_data_sets_keys(tmp_path: Path) -> None:
    from experiments.config import logged_config
    from experiments.wiring import validate

    mnist = logged_config(OmegaConf.to_container(_compose("data=mnist", "data.root=/nowhere"), resolve=True))
    assert not {"samples", "dim", "separation", "heterogeneity", "hf_name", "image_key"} & set(mnist["data"])
    assert {"name", "partition", "root", "download"} <= set(mnist["data"])
    synth = logged_config(OmegaConf.to_container(_compose("data=synthetic"), resolve=True))
    assert {"samples", "dim", "separation"} <= set(synth["data"]) and "root" not in synth["data"]
    job = validate(_compose("trainer.mode=simulated"), out_dir=str(tmp_path)).job()  # digits: what W&B gets
    assert "samples" not in job.config["data"] and job.config["aggregator"] == dict(job.build.cfg["aggregator"])


# --- W&B start-up off the critical path ----------------------------------------------------------
class _SlowRun:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.summary: dict[str, Any] = {}
        self.finished: Any = None

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((step, data))

    def finish(self, exit_code: int = 0) -> None:
        self.finished = exit_code


def test_wandb_start_up_does_not_block_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from robustagg.launch.wandb_sink import WandbSink

    release = threading.Event()
    run = _SlowRun()

    def slow_init(**kw: Any) -> _SlowRun:
        release.wait(120)  # W&B's start-up: about 10 s on the development machine
        return run

    monkeypatch.setattr(wandb, "init", slow_init)
    made: list[WandbSink] = []
    t = threading.Thread(target=lambda: made.append(WandbSink({"project": "t"}, {"a": 1}, str(tmp_path), name="r")))
    t.start()
    t.join(60)
    assert not t.is_alive() and made, "WandbSink waited for wandb.init"
    sink = made[0]
    for step in (1, 2, 3):
        sink.log({"kind": "train", "step": step, "x": float(step)}, step)  # queued, not blocked
    sink.summary({"final_test_acc": 0.5})
    assert run.logged == []
    release.set()
    sink.close()
    assert [s for s, _ in run.logged] == [1, 2, 3] and run.summary == {"final_test_acc": 0.5} and run.finished == 0
    assert json.loads((tmp_path / "wandb_run.json").read_text())["last_step"] == 3


def test_a_wandb_that_cannot_start_does_not_stop_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    wandb = pytest.importorskip("wandb")
    from robustagg.launch.wandb_sink import WandbSink

    def broken(**kw: Any) -> None:
        raise RuntimeError("no W&B service")

    monkeypatch.setattr(wandb, "init", broken)
    sink = WandbSink({"project": "t"}, {}, str(tmp_path), name="r")
    sink.log({"kind": "train", "step": 1, "x": 1.0}, 1)
    caplog.set_level("WARNING")
    sink.close()
    assert "W&B did not start" in caplog.text and "no W&B service" in caplog.text


# --- the report says why a column is empty -------------------------------------------------------
def test_report_says_which_runs_an_empty_column_needs(tmp_path: Path) -> None:
    from experiments.report import build_report
    from tests.test_report import make_run

    root = tmp_path / "sweep"
    for job, (rule, attack, acc) in enumerate([("krum", "alie", 0.7), ("krum", "sign_flip", 0.6),
                                               ("coordinate_median", "alie", 0.65)]):
        make_run(root, job, rule, attack, "iid", 0, acc)
    report = build_report(root, tmp_path / "out", wandb=False)
    text = report.markdown
    assert "needs an attack=none run in the sweep" in text
    assert "needs a run of the mean rule" in text  # suppression and acc_drop_vs_mean compare with the mean


def test_of_jobs_that_end_together_exactly_one_prints_the_summary(tmp_path: Path) -> None:
    """Two parallel jobs ending together both saw the sweep complete after their own record and both printed
    the summary (a failure under load): whether a record completes the sweep is decided under the count's lock."""
    import contextlib
    import io
    import threading

    for trial in range(5):
        root = tmp_path / f"s{trial}"
        sp.start(root, jobs=8)
        out = io.StringIO()
        gate = threading.Barrier(8)

        def job(j: int) -> None:
            gate.wait()
            sp._report(str(root), j, "ok", f"job {j}")

        with contextlib.redirect_stdout(out):
            threads = [threading.Thread(target=job, args=(j,)) for j in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert out.getvalue().count("sweep finished:") == 1, out.getvalue()
    line, completed = sp._finish(root, 3, "ok", "job 3 again")  # a re-run of a finished sweep's job
    assert not completed and line.startswith("[8 of 8 done]")
