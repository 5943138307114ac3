"""The decentralised results collector (experiments.decentralised_page) on hand-made run folders:
a newer run of a cell replaces the older, skipped runs keep their reason, and the tables say what
the files hold."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from experiments import decentralised_page as dp


def _run(root: Path, job: str, *, topology: str, rule: str, attack: str, acc: float, worst: float,
         spread: float, skipped: str = "") -> None:
    d = root / job
    (d / ".hydra").mkdir(parents=True)
    cfg = {"data": {"name": "digits"}, "seed": 0, "protocol": {"topology": topology, "node_rule": rule}}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"attack={attack}"]))
    (d / "job_timing.json").write_text(json.dumps({"cpu_s": 2.0, "wall_s": 2.5}))
    if skipped:
        (d / "skipped.json").write_text(json.dumps({"status": "skipped", "reason": skipped}))
        return
    (d / "summary.json").write_text(json.dumps({"final_test_acc": acc, "final_test_acc_worst_node": worst,
                                                "final_test_acc_average_model": acc,
                                                "final_consensus_distance": spread}))
    recs = [{"kind": "train", "step": s, "gossip/consensus_distance": spread * s, "gossip/kappa_mean": 0.5}
            for s in (5, 10)] + [{"kind": "test", "step": 10, "test/acc": acc, "test/acc_worst_node": worst,
                                  "test/acc_best_node": 1.0}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_collect_replaces_a_cell_keeps_the_others_and_renders_them(tmp_path):
    a = tmp_path / "sweep_a"
    _run(a, "0", topology="ring", rule="gossip", attack="dissensus", acc=0.8, worst=0.5, spread=2.0)
    _run(a, "1", topology="ring", rule="bridge_trimmed_mean", attack="dissensus", acc=0, worst=0, spread=0,
         skipped="honest nodes 0, 1 (degree 2): BRIDGE-T cannot trim")
    _run(a, "2", topology="torus", rule="gossip", attack="dissensus", acc=0.9, worst=0.7, spread=0.1)
    out = dp.collect("dec", a, results=tmp_path / "results")
    b = tmp_path / "sweep_b"
    _run(b, "0", topology="ring", rule="gossip", attack="dissensus", acc=0.6, worst=0.25, spread=3.0)
    dp.collect("dec", b, results=tmp_path / "results")
    t = pd.read_csv(out / "results.csv", keep_default_na=False, na_values=[""])
    assert len(t) == 3 and sorted(t["run_id"]) == ["sweep_a/1", "sweep_a/2", "sweep_b/0"]
    ring = t[(t["topology"] == "ring") & (t["node_rule"] == "gossip")].iloc[0]
    assert (ring["final_acc"], ring["worst_node_acc"], ring["best_node_acc"], ring["kappa_mean"]) == (0.6, 0.25, 1.0, 0.5)
    curves = pd.read_csv(out / "curves.csv")
    assert curves[curves["run_id"] == "sweep_b/0"]["consensus_distance"].tolist() == [15.0, 30.0]
    assert "sweep_a/0" not in set(curves["run_id"])  # the replaced run's curve is gone too
    assert (out / "curves_dissensus.png").is_file()
    assert json.loads((out / "cost.json").read_text()) == {"cpu_seconds": 6.0, "runs": 3,
                                                           "status": {"ok": 2, "skipped": 1}}
    acc = dp.accuracy_table(out)
    assert "| gossip | 25.0 (60.0) | 70.0 (90.0) |" in acc and "| bridge_trimmed_mean | skipped | – |" in acc
    assert "| gossip | 3.0e+00 | 1.0e-01 |" in dp.consensus_table(out)
    assert dp.cost_line(out) == "3 runs (2 ok, 1 skipped); 0.00 CPU-hours.\n"


def test_collect_from_a_folder_without_runs_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert dp.main(["collect", "x", str(tmp_path / "empty")]) == 2
    assert "no run found" in capsys.readouterr().err
