"""A real process racing for run locks (tests/test_run_transaction.py).

``python lock_racer.py ROOT NAME TRIALS``: for every trial ``k`` it waits at the start line
``ROOT/go-k`` (the test creates it when both racers are ready), tries
``RunLock(ROOT/trial-k).acquire()``, and records ``held`` or ``refused`` in ``ROOT/NAME-k``; it never
releases, so a lock two processes both believe they hold shows up as two ``held`` records.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from robustagg.launch import RunLock, RunLockedError


def main() -> None:
    root, name, trials = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    held = []
    for k in range(trials):
        (root / f"{name}-ready-{k}").touch()
        go = root / f"go-{k}"
        while not go.exists():
            time.sleep(0.0005)
        try:
            held.append(RunLock(root / f"trial-{k}", what=name).acquire())
            verdict = "held"
        except RunLockedError:
            verdict = "refused"
        (root / f"{name}-{k}").write_text(verdict)


if __name__ == "__main__":
    main()
