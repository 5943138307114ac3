"""docs/howto/own-script.md, run as printed: a researcher's own script gets the library's lifecycle.

Own model and data (an iterable source), Adam, Mimic (stateful) through AttackAdapter, committed
checkpoints, a real SIGKILL of worker 2 at step 12, the restart and an elastic shrink from 6 to 5;
then the same command again resumes the finished run, and a changed fingerprint is refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from robustagg.checkpoint import load_state, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "howto" / "own-script.md").read_text()
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _script() -> str:
    (block,) = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)
    return block


@pytest.mark.slow
def test_own_script_restarts_shrinks_and_resumes(tmp_path):
    script = tmp_path / "robust_script.py"
    script.write_text(_script())
    run = tmp_path / "runs" / "mine"
    p = subprocess.run([sys.executable, str(script), str(run)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (out["steps"], out["n"], out["n_initial"], out["workers"], out["restarts"]) == (30, 5, 6, [0, 1, 3, 4, 5], 1)
    assert out["final_test_acc"] > 0.8
    restore, shrink = [r for r in read_jsonl(run / "checkpoints" / "lineage.jsonl") if r["event"] in ("restore", "shrink")]
    assert restore["restored_from"] == 10 and restore["steps_replayed"] == [11, 11] and "SIGKILL" in restore["reason"]
    assert (shrink["old_n"], shrink["new_n"], shrink["lost_workers"]) == (6, 5, [2])
    # Adam's moments and the attack's state are in the committed end state
    end = run / "checkpoints" / "step-00000030"
    manifest = json.loads((end / "manifest.json").read_text())
    assert manifest["fingerprint"]["script"] == "robust_script" and manifest["hosts"]["rank-4.pt"] == [5]
    rep = load_state(end / "replicated.pt")
    assert rep["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0
    byz = load_state(end / "rank-4.pt")  # worker 5 (Byzantine) is rank 4 after the shrink
    assert byz["attack"] and byz["workers"][5]["sampler"]["epoch"] >= 1
    # the same command again: nothing left to do, it says so
    again = subprocess.run([sys.executable, str(script), str(run)], cwd=tmp_path, env=ENV, capture_output=True,
                           text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resume: found step-00000030" in again.stderr
    # ... with the membership the checkpoint committed (5 workers after the shrink), not the configured 6
    out2 = json.loads((run / "summary.json").read_text())
    assert (out2["n"], out2["workers"], out2["steps_this_run"], out2["restarts"]) == (5, [0, 1, 3, 4, 5], 0, 0)
    assert not list((run / "checkpoints").glob("*rejected*")), "a committed checkpoint was set aside"
    # a changed experiment on the same run directory is refused before any process starts
    script.write_text(_script().replace('"lr": 1e-2', '"lr": 1e-3'))
    bad = subprocess.run([sys.executable, str(script), str(run)], cwd=tmp_path, env=ENV, capture_output=True,
                         text=True, timeout=400)
    assert bad.returncode != 0 and "lr: 0.01 (checkpoint) -> 0.001 (now)" in bad.stderr
