"""The availability-vs-bias sweep (issue 15): both axes in one sweep, the report's two figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def test_the_full_sweep_has_both_axes_and_every_cell_validates(tmp_path):
    from experiments.wiring import validate

    text = (CONF / "experiment" / "availability_vs_bias.yaml").read_text()
    assert "sync,local_k5,local_k7,local_k10,async_t0,async_t1,async_t2,async_t4" in text
    for choice in ("sync", "local_k5", "local_k7", "local_k10", "async_t0", "async_t4"):
        for rule in ("mean", "trimmed_mean", "coordinate_median", "geometric_median"):
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose("config", overrides=["+experiment=availability_vs_bias", f"+experiment/availability={choice}",
                                                   f"+experiment/rule={rule}", "attack=alie", f"out_dir={tmp_path}"])
            validate(cfg)  # raises on a requirement that fails at the rows per update


@pytest.mark.slow
def test_quick_sweep_measures_bias_on_both_axes_and_the_report_draws_them(tmp_path):
    from experiments.report import build_report

    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "-m", "+experiment=availability_vs_bias_quick",
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = build_report(sweep, wandb=False)
    r = report.results
    local, asy = r[r["protocol"] == "localrounds"], r[r["protocol"] == "asyncsgd"]
    assert sorted(local["participation"]) == [0.5, 1.0] and local["tau"].isna().all()
    assert sorted(asy["tau"]) == [0, 4] and asy["participation"].isna().all()
    assert (report.results["status"] == "ok").all()
    assert report.results["mean_bias_vs_sync_rel"].gt(0).all()  # a robust rule under attack is biased
    for d in sweep.iterdir():
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            assert s["protocol"] in ("local", "async") and s["mean_bias_vs_sync"] > 0
    assert {"availability_participation.png", "availability_tau.png"} <= {p.name for p in report.files}
    assert "## Availability against bias" in report.markdown and "| rel. bias |" in report.markdown
    assert report.markdown.startswith("# Availability against bias: report of")


def test_the_availability_table_averages_seeds_per_protocol_cell():
    import math

    import pandas as pd

    from experiments.report_tables import availability_table

    nan = math.nan
    rows = [  # (attack, rule, protocol, participation, tau, seed, bias, rel, acc)
        ("alie", "trimmed_mean", "localrounds", 0.5, nan, 0, 0.2, 0.4, 0.90),
        ("alie", "trimmed_mean", "localrounds", 0.5, nan, 1, 0.4, 0.6, 0.80),
        ("alie", "trimmed_mean", "asyncsgd", nan, 4, 0, 0.3, 0.7, 0.70),
        ("none", "trimmed_mean", "localrounds", 0.5, nan, 0, 0.1, 0.2, 0.95),
    ]
    runs = pd.DataFrame([dict(attack=a, rule=r, protocol=p, participation=q, tau=t, seed=s, mean_bias_vs_sync=b,
                              mean_bias_vs_sync_rel=rel, final_acc=acc, status="ok") for a, r, p, q, t, s, b, rel, acc
                         in rows])
    table = availability_table(runs)
    assert list(table["attack"]) == ["none", "alie", "alie"]  # the field's attack order, no attack first
    cell = table[(table["attack"] == "alie") & (table["protocol"] == "localrounds")].iloc[0]
    assert cell["bias"] == pytest.approx(0.3) and cell["rel. bias"] == pytest.approx(0.5)
    assert cell["acc (%)"] == pytest.approx(85.0) and cell["seeds"] == 2 and cell["tau"] == "—"
    assert availability_table(runs.assign(mean_bias_vs_sync=nan)) is None  # not an availability sweep
