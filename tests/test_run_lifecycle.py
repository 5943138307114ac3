"""The run around the optimizer transition is a transaction too (issue 13, items 2, 3, 4, 9, 10, 11).

Real processes killed for real: one launch per run directory (a second one is refused while the
first lives; a dead owner's lock is taken over), "kill, then run the same command again" resumes a
stable ``run_name`` folder, every train step and every evaluation is in ``metrics.jsonl`` exactly
once after any kill point (including right after a commit, and a re-run after a kill before the
first checkpoint), one W&B run per run directory, and a resumed run says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.checkpoint import read_jsonl
from robustagg.launch import RunLock, RunLockedError, settle_metrics
from robustagg.training import JsonlSink

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = {**os.environ, "WANDB_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
SMALL = ["logger=none", "trainer.progress=false", "threat.n=3", "threat.f=1", "aggregator=coordinate_median",
         "attack=sign_flip", "trainer.batch_size=16", "trainer.param_check_every=0", "trainer.collective_timeout_s=60"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*SMALL, *overrides])


def _steps(run: Path, kind: str = "train") -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == kind]


def _cli(args, cwd, **kw):
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *SMALL, *args], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(path: Path, seconds: float = 240.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.05)


# --- the run lock ---------------------------------------------------------------------------------
def test_lock_held_by_a_live_process_refuses_and_a_dead_owner_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from robustagg.launch import RunLock; "
                               "RunLock(sys.argv[1], what='holder').acquire(); print('held', flush=True); "
                               "time.sleep(120)", str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"in use by another launch: PID {holder.pid} on this host"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path).acquire()  # the owner died (SIGKILL): a stale lock
    assert lock.took_over["pid"] == holder.pid and json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_lock_of_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": time.time()}))
    with pytest.raises(RunLockedError, match=r"host 'elsewhere'.*delete .*run\.lock"):
        RunLock(tmp_path).acquire()
    assert socket.gethostname() != "elsewhere"


@pytest.mark.slow
def test_second_launch_on_one_run_directory_is_refused_while_the_first_runs(tmp_path):
    go = tmp_path / "go"
    hold = [f"trainer.callbacks=[{{_target_: lifecycle_helpers.WaitForFile, path: '{go}', step: 5}}]",
            "trainer.collective_timeout_s=400"]  # A waits after step 5 until B has been refused
    a = _cli(["run_name=shared", "seed=0", "trainer.steps=60", "trainer.checkpoint.every=10", *hold], tmp_path)
    run = tmp_path / "outputs" / "shared"
    _wait_for(run / "run.lock")
    b = _cli(["run_name=shared", "seed=1", "trainer.steps=60", "trainer.checkpoint.every=10"], tmp_path)
    out_b, err_b = b.communicate(timeout=300)
    go.touch()
    out_a, err_a = a.communicate(timeout=400)
    assert b.returncode == 2 and "is in use by another launch" in err_b and f"PID {a.pid}" in err_b, err_b[-2000:]
    assert "Traceback" not in err_b
    assert a.returncode == 0, err_a[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["seed"] == 0 and s["resumed_from"] is None and _steps(run) == list(range(1, 61))
    assert not (run / "run.lock").exists()


# --- kill, then run the same command again -----------------------------------------------------------
@pytest.mark.slow
def test_kill_the_whole_launch_then_rerun_the_same_command_resumes(tmp_path):
    args = ["run_name=demo", "trainer.steps=40", "trainer.checkpoint.every=10", "trainer.eval_every=10"]
    first = _cli(args, tmp_path, start_new_session=True)
    run = tmp_path / "outputs" / "demo"
    _wait_for(run / "checkpoints" / "step-00000010" / "manifest.json")
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every worker, as a scheduler would
    first.communicate(timeout=60)
    second = _cli(args, tmp_path)
    out, err = second.communicate(timeout=400)
    assert second.returncode == 0, err[-3000:]
    s = json.loads((run / "summary.json").read_text())
    both = out + err
    assert s["resumed_from"] in (10, 20, 30) and f"resume: found step-{s['resumed_from']:08d}" in both
    assert "resumed from step" in both and "│ resumed from" in out  # the log line and the summary row
    assert s["steps"] == 40 and s["steps_this_run"] == 40 - s["resumed_from"]
    assert _steps(run) == list(range(1, 41)) and _steps(run, "test") == [0, 10, 20, 30, 40]


# --- metrics are part of the transaction ---------------------------------------------------------
@pytest.mark.slow
def test_a_kill_right_after_a_commit_loses_no_record(tmp_path):
    s = train(_cfg("trainer.steps=20", "trainer.checkpoint.every=10", "trainer.eval_every=5", "trainer.max_restarts=1",
                   "faults=[crash]", "faults.crash.rank=0", "faults.crash.step=10", "faults.crash.where=after_commit"),
              out_dir=tmp_path, quiet=True)
    assert s["restarts"] == 1 and s["resumed_from"] == 10
    assert _steps(tmp_path) == list(range(1, 21)) and _steps(tmp_path, "test") == [0, 5, 10, 15, 20]


@pytest.mark.slow
def test_rerun_after_a_kill_before_the_first_checkpoint_writes_every_step_once(tmp_path):
    args = ("trainer.steps=8", "trainer.checkpoint.every=5", "trainer.eval_every=4", "faults=[crash]",
            "faults.crash.rank=1", "faults.crash.step=4")
    with pytest.raises(Exception, match="died"):
        train(_cfg(*args), out_dir=tmp_path, quiet=True)
    assert 1 in _steps(tmp_path)  # the first attempt wrote some steps before it died
    s = train(_cfg(*args), out_dir=tmp_path, quiet=True)  # the same command again (the fault fired once)
    assert s["resumed_from"] is None
    assert _steps(tmp_path) == list(range(1, 9)) and _steps(tmp_path, "test") == [0, 4, 8]


def test_settle_metrics_cuts_back_to_the_restored_step_and_dedupes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "train", "step": s} for s in (1, 2, 3, 1, 2, 3, 4)] + [{"kind": "test", "step": 4},
                                                                            {"kind": "test", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tra')  # a torn last line
    assert settle_metrics(path, 3) == 7  # 3 duplicates, step 4 (train and twice test), the torn line
    assert [(r["kind"], r["step"]) for r in read_jsonl(path)] == [("train", 1), ("train", 2), ("train", 3)]
    sink = JsonlSink(path)
    for step in (3, 4):
        sink.log({"kind": "train", "step": step}, step)  # step 3 is already there: skipped
    sink.log({"kind": "test", "step": 4}, 4)
    sink.log({"kind": "test", "step": 4}, 4)  # the final evaluation of a re-run after a kill at the end
    sink.close()
    assert [(r["kind"], r["step"]) for r in read_jsonl(path)] == [("train", 1), ("train", 2), ("train", 3),
                                                                  ("train", 4), ("test", 4)]


# --- W&B after a restart -------------------------------------------------------------------------
def test_wandb_resumes_the_run_of_the_run_directory_and_skips_logged_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from robustagg.launch.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged: list[int] = []
    first = WandbSink({"project": "t"}, {"a": 1}, str(tmp_path), name="r")
    monkeypatch.setattr(first.run, "log", lambda data, step: logged.append(step))
    for step in range(1, 6):
        first.log({"kind": "train", "step": step, "x": 1.0}, step)
    first.failed = True
    first.close()  # killed after step 5
    second = WandbSink({"project": "t"}, {"a": 1}, str(tmp_path), name="r")
    assert second.resumed and second.run_id == first.run_id and second.last_step == 5
    monkeypatch.setattr(second.run, "log", lambda data, step: logged.append(step))
    for step in range(3, 8):  # restored from step 2: steps 3..5 are replayed
        second.log({"kind": "train", "step": step, "x": 1.0}, step)
    second.close()
    assert logged == [1, 2, 3, 4, 5, 6, 7]


# --- resume is visible ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_resumed_run_says_where_it_resumed_and_counts_its_own_steps(tmp_path, caplog, capsys):
    base = ("trainer.mode=simulated", "trainer.checkpoint.every=5", "trainer.eval_every=0")
    train(_cfg(*base, "trainer.steps=10"), out_dir=tmp_path, quiet=True)
    caplog.set_level("WARNING")
    s = train(_cfg(*base, "trainer.steps=14", "trainer.progress=true"), out_dir=tmp_path)
    text = caplog.text
    assert "resume: found step-00000010" in text and "resumed from step 10 (checkpoint step-00000010, verified)" in text
    assert s["steps"] == 14 and s["steps_this_run"] == 4 and s["resumed_from"] == 10
    assert abs(s["seconds_per_step"] - s["wall_seconds"] / 4) < 1e-9
    captured = capsys.readouterr()
    assert "resumed from" in captured.out and "step 10 (step-00000010, verified)" in captured.out
    assert "10/14" in captured.err  # the progress bar starts at the restored step


# --- stop means stop -------------------------------------------------------------------------------
def _interrupt(proc: subprocess.Popen, run: Path, sig: int, code: int, after: int) -> int:
    """Send ``sig`` to the launcher once ``run`` has ``after`` train steps; check the stop; return its step."""
    deadline = time.monotonic() + 240
    while len(_steps(run)) < after:  # training is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(sig)  # to the launcher only, as SLURM preemption or Ctrl-C would
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == code, err[-3000:]
    m = re.search(r"interrupted at step (\d+); run the same command to resume", err)
    assert m and "Traceback" not in err, err[-3000:]
    step = int(m.group(1))
    assert (run / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert after <= step < 400 and _steps(run) == list(range(1, step + 1))
    return step


@pytest.mark.slow
def test_sigterm_and_sigint_take_a_final_checkpoint_and_the_same_command_resumes(tmp_path):
    # One chain of three launches: SIGTERM stops a fresh run (143), the same command resumes it and
    # SIGINT stops the resumed run (130), then the run resumes from that final checkpoint and ends.
    args = ["run_name=stop", "trainer.steps=400", "trainer.checkpoint.every=1000", "trainer.eval_every=0"]
    run = tmp_path / "outputs" / "stop"
    first = _interrupt(_cli(args, tmp_path), run, signal.SIGTERM, 143, after=5)
    second = _interrupt(_cli(args, tmp_path), run, signal.SIGINT, 130, after=first + 5)
    last = _cli(args[:1] + ["trainer.steps=" + str(second + 3)] + args[2:], tmp_path)
    _, err = last.communicate(timeout=400)
    assert last.returncode == 0, err[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["resumed_from"] == second and _steps(run) == list(range(1, second + 4))
