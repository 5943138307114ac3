"""The commands of docs/howto/resume.md, as a user types them: the app's launcher restarting after a
SIGKILL between the ranks' optimizer steps, and torchrun's own restarts (real processes, slow)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOWTO = (ROOT / "docs" / "howto" / "resume.md").read_text()
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _command(prefix: str) -> list[str]:
    (line,) = [x for x in HOWTO.splitlines() if x.startswith(prefix)]  # the page's command, verbatim
    return shlex.split(line)


@pytest.mark.slow
def test_howto_crash_between_demo(tmp_path):
    cmd = _command("python -m experiments.train threat.n=4")
    p = subprocess.run([sys.executable, *cmd[1:], "logger=none", "trainer.progress=false"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "crash-demo"
    s = json.loads((run / "summary.json").read_text())
    (rec,) = s["lineage"]
    # as the page says: restored from step 4, steps 5..7 replayed, detected at step 8's exchange
    assert (rec["restored_from"], rec["steps_replayed"], s["restarts"], s["steps"]) == (4, [5, 7], 1, 12)
    assert rec["reason"].startswith("fail-stop detected at step 8: worker rank 2 died (signal SIGKILL)")
    assert sorted(p.name for p in (run / "evidence" / "attempt-0").iterdir()) == ["rank-0.json", "rank-1.json",
                                                                                 "rank-3.json"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000012"


@pytest.mark.slow
def test_howto_torchrun_restart_restores_the_committed_checkpoint(tmp_path):
    pytest.importorskip("torch.distributed.run")
    cmd = _command("torchrun --standalone")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:], "logger=none",
                        "trainer.progress=false", "trainer.eval_every=0"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "torchrun-demo"
    s = json.loads((run / "summary.json").read_text())
    # it joined torchrun's group (no processes of its own) and ran to the end
    assert s["n"] == 2 and s["mode"] == "processes" and s["byzantine_ranks"] == []
    assert s["steps"] == 6 and s["restarts"] == 1  # TORCHELASTIC_RESTART_COUNT
    (rec,) = s["lineage"]
    assert rec["restored_from"] == 2 and rec["steps_replayed"] == [3, 3] and rec["reason"].startswith("torchrun restart 1")
    assert [(f["kind"], f["rank"], f["step"]) for f in s["faults"]["injected"]] == [("crash", 1, 4)]  # fired once
    # torchrun's agent stops the survivor itself; rank 0 usually writes its evidence first (then the
    # detection names step 4 and only rank 1 as lost), but the race can go the other way, when the
    # supervisor sees no evidence at all and counts both ranks as lost at an unknown step.
    ((kind, step, lost),) = [(d["kind"], d["step"], d["lost"]) for d in s["faults"]["detected"]
                             if d["kind"] != "straggler"]
    archived = run / "evidence" / "attempt-0"  # archived only when some rank wrote evidence
    evidence = sorted(p.name for p in archived.iterdir()) if archived.exists() else []
    assert kind == "fail-stop" and 1 in lost and evidence in (["rank-0.json"], [])
    if evidence:
        assert (step, lost) == (4, [1])
