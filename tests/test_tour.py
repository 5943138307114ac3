"""The main job (``make run`` = ``python -m experiments.tour``): six cells, one table, files beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.tour import CELLS, tour

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.slow
def test_tour_trains_every_cell_from_the_same_seed(tmp_path):
    rows = tour([f"out_dir={tmp_path}", "trainer.steps=6", "trainer.batch_size=16"], quiet=True)
    assert [(r["rule"], r["attack"]) for r in rows] == [(rule, a) for rule in ("mean", "trimmed_mean") for a in CELLS]
    none = {r["rule"]: r for r in rows if r["attack"] == "none"}
    assert none["mean"]["mean_kappa_hat"] < 1e-10 < none["trimmed_mean"]["mean_kappa_hat"]  # suppression
    noisy = {r["rule"]: r for r in rows if r["attack"] == "gaussian"}
    assert noisy["mean"]["mean_kappa_hat"] > 100 * noisy["trimmed_mean"]["mean_kappa_hat"]  # integrity
    assert json.loads((tmp_path / "tour.json").read_text()) == rows
    assert (tmp_path / "tour.md").read_text().count("\n") == 2 + len(rows)
    for r in rows:
        s = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert s["seed"] == 0 and s["mode"] == "simulated" and s["n"] == 10 and s["f"] == 3


def test_a_bad_override_is_refused_before_any_cell_trains(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.tour", f"out_dir={tmp_path / 'x'}", "trainer.lrr=1"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "trainer.lrr" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x").exists()
