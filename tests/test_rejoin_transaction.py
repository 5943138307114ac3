"""Stops and refusals around a rejoin, with real processes (issue 27, items 8, 9 and 13).

A SIGTERM while a replacement waits to be admitted stops the members at one committed step and
says so (the waiting replacement is not a member: it does not vote on the stop).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robustagg.checkpoint import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
SIX = ["logger=none", "trainer.progress=false", "threat.n=6", "threat.f=0", "aggregator=mean", "attack=none",
       "trainer.batch_size=8", "trainer.eval_every=0", "trainer.param_check_every=0",
       "trainer.collective_timeout_s=60", "trainer.checkpoint.every=1", "trainer.max_restarts=1",
       "trainer.on_failure=shrink", "trainer.rejoin=true"]


def _train_steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]


def _wait(cond, what: str, proc: subprocess.Popen, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)


def test_sigterm_while_a_replacement_waits_stops_the_members_at_one_committed_step(tmp_path):
    # worker 5 dies at the start of step 4; the five restore step 3 and go on; its replacement asks to
    # join and waits for the boundary after step 12. Rank 0 holds after step 7 until the test lets it
    # go, so the SIGTERM lands while the replacement is still waiting.
    gate, run = tmp_path / "go", tmp_path / "run"
    hold = f"trainer.callbacks=[{{_target_: lifecycle_helpers.WaitForFile, path: '{gate}', step: 7}}]"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *SIX, "trainer.steps=14", "faults=[rejoin]",
                             "faults.rejoin.rank=5", "faults.rejoin.step=4", "faults.rejoin.seconds=0.2",
                             "faults.rejoin.join_step=12", hold, f"hydra.run.dir={run}"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (run / "metrics.jsonl").exists() and 6 in _train_steps(run), "step 6 of the five", proc)
        time.sleep(2.0)  # rank 0 holds after step 7; the replacement (back 0.2 s after the restart) waits
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler's preemption would
        time.sleep(1.0)
        gate.write_text("go")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    m = re.search(r"interrupted at step (\d+); run the same command to resume \(SIGTERM; committed checkpoint at "
                  r"step (\d+)\)", err)
    assert m and m.group(1) == m.group(2), err[-3000:]
    assert "different stop steps" not in err and "Traceback" not in err, err[-3000:]
    step = int(m.group(1))
    assert 7 < step < 12 and (run / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
