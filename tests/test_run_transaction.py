"""The run transaction's remaining holes (issue 27, items 1-7 and 11).

Real processes where the failure needs them: two lock racers over many trials, two launchers
sharing one checkpoint folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _wait_for(paths: list[Path], seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"{[str(p) for p in paths if not p.exists()]} did not appear"
        time.sleep(0.001)


# --- item 1: the run lock is written whole, then linked into place ---------------------------------
def test_two_processes_racing_for_one_lock_never_both_hold_it(tmp_path):
    trials = 150
    racers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "lock_racer.py"), str(tmp_path), name,
                                str(trials)], env=ENV) for name in ("a", "b")]
    try:
        for k in range(trials):
            _wait_for([tmp_path / f"a-ready-{k}", tmp_path / f"b-ready-{k}"])
            (tmp_path / f"go-{k}").touch()
        for p in racers:
            assert p.wait(timeout=300) == 0
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
    verdicts = [sorted((tmp_path / f"{n}-{k}").read_text() for n in ("a", "b")) for k in range(trials)]
    both = [k for k, v in enumerate(verdicts) if v == ["held", "held"]]
    assert not both, f"both racers held the lock in {len(both)} of {trials} trials: {both[:10]}"
    assert all(v == ["held", "refused"] for v in verdicts), verdicts


@pytest.mark.parametrize("content", ["", '{"host": "h', "[1, 2]", "\x00\x01"])
def test_an_empty_or_partly_written_lock_counts_as_held_never_stale(tmp_path, content):
    from robustagg.launch import RunLock, RunLockedError

    (tmp_path / "run.lock").write_text(content)
    with pytest.raises(RunLockedError, match=r"cannot be read as a lock record .* counts as held.*delete .*run\.lock"):
        RunLock(tmp_path).acquire()
    assert (tmp_path / "run.lock").read_text() == content  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock.guard", "run.lock"]  # no temp file left
