"""Compare the training-loss curves of two runs (``metrics.jsonl``) step by step; used by ``scripts/gpu_check.sh``.

Usage::

    python scripts/compare_curves.py RUN_A RUN_B [--tol 0.02] [--labels cpu cuda]

Reads the ``train`` records (``{"kind": "train", "step": s, "train/loss": l}``) of both run
folders, prints both curves side by side, and the largest relative difference
``max_s |a_s - b_s| / max(|a_s|, |b_s|)`` over the steps both runs logged. Exit status: 0 when it is
at most ``--tol``, 1 when it is larger, 2 when a run has no training records or the two runs
logged different steps (the comparison is not meaningful).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence


def loss_curve(run: Path) -> dict[int, float]:
    """``{step: train/loss}`` of a run folder's ``metrics.jsonl`` (the last record of a step wins)."""
    curve: dict[int, float] = {}
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "train" and "train/loss" in rec:
            curve[int(rec["step"])] = float(rec["train/loss"])
    return curve


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    """``max_s |a_s - b_s| / max(|a_s|, |b_s|)`` over the steps of ``a`` (0 where both are 0; inf for NaN)."""
    worst = 0.0
    for s in a:
        x, y = a[s], b[s]
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        den = max(abs(x), abs(y))
        worst = max(worst, abs(x - y) / den if den > 0 else 0.0)
    return worst


def main(argv: Sequence[str]) -> int:
    """The command line; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--tol", type=float, default=0.02, help="largest accepted relative difference (default 0.02)")
    ap.add_argument("--labels", nargs=2, default=["a", "b"], metavar=("A", "B"))
    args = ap.parse_args(list(argv))
    a, b = loss_curve(args.run_a), loss_curve(args.run_b)
    la, lb = args.labels
    if not a or not b:
        print(f"compare_curves: no training records in {args.run_a if not a else args.run_b}", file=sys.stderr)
        return 2
    if sorted(a) != sorted(b):
        print(f"compare_curves: the runs logged different steps ({la}: {len(a)}, {lb}: {len(b)})", file=sys.stderr)
        return 2
    print(f"{'step':>6} {la + ' loss':>14} {lb + ' loss':>14} {'rel diff':>10}")
    for s in sorted(a):
        den = max(abs(a[s]), abs(b[s]))
        rel = abs(a[s] - b[s]) / den if den > 0 else 0.0
        print(f"{s:>6} {a[s]:>14.6f} {b[s]:>14.6f} {rel:>10.2e}")
    worst = max_relative_difference(a, b)
    verdict = "ok" if worst <= args.tol else "FAIL"
    print(f"max relative difference of train/loss ({la} vs {lb}): {worst:.3e} (tolerance {args.tol:g}): {verdict}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
