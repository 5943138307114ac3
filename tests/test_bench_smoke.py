"""Smoke test of ``python -m experiments.bench``: it runs from the repository root and writes its CSV.

No timing assertions (speed is what the benchmark reports, not what tests check).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_writes_the_csv(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "experiments.bench", "quick=true", "repeats=1", "warmup=0",
           "rules=[mean,coordinate_median,meamed,krum,geometric_median,'nnm>trimmed_mean','bucketing>coordinate_median',bulyan]",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(tmp_path / "bench.csv")
    from experiments.bench import COLUMNS

    assert list(table.columns) == COLUMNS
    for col in ["rule", "n", "f", "d", "dtype", "device", "median_ms", "ratio_to_mean", "naive_ms",
                "speedup_vs_naive", "peak_extra_mem_x"]:
        assert col in table.columns
    assert set(table["rule"]) == {"mean", "coordinate_median", "meamed", "krum", "geometric_median",
                                  "nnm>trimmed_mean", "bucketing>coordinate_median", "bulyan"}
    ran = table[table["note"].isna()]
    assert len(ran) == 7 and (ran["median_ms"] > 0).all() and (ran["naive_ms"] > 0).all()
    skipped = table[table["rule"] == "bulyan"]  # n = 10, f = 2 breaks n >= 4f + 3: recorded, not run
    assert skipped["note"].str.startswith("skipped").all()
    assert not (tmp_path / "bench.csv.tmp").exists()
