"""The sweep report on small hand-made run folders: numbers checked by hand, files, figures, CLI.

Every run folder is written here the way the trainer writes it (``.hydra/config.yaml``,
``config_resolved.yaml``, ``metrics.jsonl``, ``summary.json``; ``skipped.json`` for a refused
configuration), with final accuracies chosen so that the integrity and suppression numbers can be
worked out by hand (the arithmetic is in the comments).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import pytest
import yaml

os.environ.setdefault("WANDB_MODE", "disabled")

from experiments import report as rep  # noqa: E402
from experiments.report_figures import curve_bands, kappa_bounds  # noqa: E402
from experiments.report_load import describe_run, load_config, load_sweep  # noqa: E402
from experiments.report_tables import across_settings, add_derived, pareto_front, pivot, tradeoff  # noqa: E402
from robustagg.errors import ConfigError  # noqa: E402

TARGETS = {"mean": "robustagg.Mean", "krum": "robustagg.Krum", "coordinate_median": "robustagg.CoordinateWiseMedian",
           "trimmed_mean": "robustagg.CoordinateWiseTrimmedMean", "bulyan": "robustagg.Bulyan"}
ATTACKS = {"none": None, "alie": "attacks.ALIE", "sign_flip": "attacks.SignFlip", "backdoor": "attacks.Backdoor"}
N, F = 10, 2
SKEW = [0.1 * i for i in range(N)]  # worker i's label skew


def config(rule: str, attack: str, partition: str, seed: int, *, pre: Optional[str] = None) -> dict[str, Any]:
    return {
        "threat": {"n": N, "f": F, "byzantine": F, "ranks": None, "start_step": 0},
        "aggregator": {"_target_": TARGETS[rule], "f": F, "strict": True},
        "preaggregation": {"_target_": pre, **({"s": 2, "f": F, "strict": True} if pre else {})},
        "attack": {"_target_": ATTACKS[attack]},
        "data": {"name": "digits", "partition": partition, "alpha": 0.1, "shards_per_worker": 2},
        "model": {"_target_": "robustagg.models.MLP", "hidden": [64]},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
        "trainer": {"mode": "simulated", "steps": 4, "progress": False},
        "logger": {"name": "none", "group": "unit-sweep", "project": "robustagg"},
        "seed": seed, "strict": True, "out_dir": None,
    }


def make_run(root: Path, job: int, rule: str, attack: str, partition: str, seed: int, acc: Optional[float], *,
             kappa: float = 1.0, weights: Optional[list[float]] = None, worst: Optional[float] = None,
             skipped: Optional[str] = None, error: str = "AssumptionError", pre: Optional[str] = None,
             asr: Optional[float] = None) -> Path:
    """One run folder; ``acc=None`` leaves it without a final evaluation (a crash); ``asr``: the
    backdoor's last ``test/asr`` (half of it at the earlier evaluation)."""
    run = root / str(job)
    (run / ".hydra").mkdir(parents=True)
    cfg = config(rule, attack, partition, seed, pre=pre)
    if skipped is not None:  # refused before training: only Hydra's (unresolved) config exists
        raw = json.loads(json.dumps(cfg))
        raw["aggregator"]["f"] = "${threat.f}"
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(raw))
        (run / "skipped.json").write_text(json.dumps({"reason": skipped, "type": error}))
        return run
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    honest = N if attack == "none" else N - F
    w = weights if weights is not None else [1.0 / N] * honest
    lines = []
    for step in (1, 2, 3, 4):
        rec: dict[str, Any] = {"kind": "train", "step": step, "agg/kappa_hat": kappa * step, "train/loss": 1.0}
        rec.update({f"agg/honest_weight/{i}": w[i] for i in range(honest)})
        if attack != "none":
            rec["agg/byz_accepted"] = 0.5
        lines.append(rec)
        if step in (2, 4) and acc is not None:
            lines.append({"kind": "test", "step": step, "test/acc": acc - (0.1 if step == 2 else 0.0),
                          "test/loss": 0.5, "test/worst_class_acc": worst if worst is not None else acc - 0.2})
            if asr is not None:
                lines[-1]["test/asr"] = asr if step == 4 else asr / 2
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    if acc is None:
        text += '{"kind": "train", "st'  # torn last line of a killed run
    (run / "metrics.jsonl").write_text(text)
    if acc is not None:
        (run / "summary.json").write_text(json.dumps({"final_test_acc": acc, "label_skew": SKEW, "wall_seconds": 1.5}))
    return run


# Final accuracies of the iid setting, seeds 0 and 1 (rule, attack) -> (seed 0, seed 1)
IID = {
    ("mean", "none"): (0.90, 0.92), ("mean", "alie"): (0.50, 0.52), ("mean", "sign_flip"): (0.10, 0.12),
    ("krum", "none"): (0.80, 0.84), ("krum", "alie"): (0.70, 0.76), ("krum", "sign_flip"): (0.78, 0.80),
    ("coordinate_median", "none"): (0.86, 0.88), ("coordinate_median", "alie"): (0.60, 0.62),
    ("coordinate_median", "sign_flip"): (0.85, 0.87),
    ("trimmed_mean", "none"): (0.80, 0.82), ("trimmed_mean", "alie"): (0.60, 0.62),
}
BULYAN = "Bulyan requires n >= 4f + 3 (El Mhamdi et al., ICML 2018); got n=10, f=2."


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    job = 0
    for (rule, attack), accs in IID.items():
        for seed, acc in enumerate(accs):
            weights = [0.0, 0.0, 0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0] if (rule, attack) == ("krum", "none") else None
            make_run(root, job, rule, attack, "iid", seed, acc, kappa=0.5 if rule == "krum" else 2.0, weights=weights)
            job += 1
    # dirichlet setting, seed 0 only: must never be compared with the iid runs
    for (rule, attack), acc in {("mean", "none"): 0.80, ("krum", "none"): 0.50, ("krum", "alie"): 0.45}.items():
        make_run(root, job, rule, attack, "dirichlet", 0, acc)
        job += 1
    for seed in (0, 1):
        make_run(root, job, "bulyan", "alie", "iid", seed, None, skipped=BULYAN)
        job += 1
    # the mean diverges under ALIE on dirichlet data: scored at chance 1/10; a bad value is "invalid"
    make_run(root, job, "mean", "alie", "dirichlet", 0, None, error="NonFiniteInputError",
             skipped="honest has non-finite values (NaN or inf) in rows [0, 1]")
    make_run(root, job + 1, "krum", "sign_flip", "dirichlet", 0, None, error="ConfigError",
             skipped="trainer.lr must be > 0; got 0.")
    job += 2
    make_run(root, job, "krum", "alie", "iid", 7, None)  # crashed: no final evaluation
    return root


@pytest.fixture(scope="module")
def report(sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> rep.Report:
    return rep.build_report(sweep, tmp_path_factory.mktemp("out"), wandb=False)


def _row(df: pd.DataFrame, rule: str, attack: str, seed: int, het: str = "iid") -> pd.Series:
    sel = df[(df["rule"] == rule) & (df["attack"] == attack) & (df["seed"] == seed) & (df["heterogeneity"] == het)]
    assert len(sel) == 1, sel
    return sel.iloc[0]


def test_per_run_integrity_and_suppression_by_hand(report: rep.Report) -> None:
    r = report.results
    k = _row(r, "krum", "alie", 0)
    assert k["run/acc_drop_vs_mean"] == pytest.approx(0.70 - 0.90)  # -0.20
    assert k["run/suppression"] == pytest.approx(0.80 - 0.90)  # krum clean - mean clean = -0.10
    assert k["run/integrity"] == pytest.approx(0.70 - 0.80)  # krum attacked - krum clean = -0.10
    k1 = _row(r, "krum", "alie", 1)
    assert (k1["run/acc_drop_vs_mean"], k1["run/suppression"], k1["run/integrity"]) == pytest.approx(
        (0.76 - 0.92, 0.84 - 0.92, 0.76 - 0.84))  # (-0.16, -0.08, -0.08): same seed only
    m = _row(r, "mean", "sign_flip", 1)
    assert (m["run/suppression"], m["run/integrity"]) == pytest.approx((0.0, 0.12 - 0.92))
    clean = _row(r, "coordinate_median", "none", 0)
    assert (clean["run/suppression"], clean["run/integrity"]) == pytest.approx((0.86 - 0.90, 0.0))
    d = _row(r, "krum", "alie", 0, "dirichlet(a=0.1)")  # compared with the dirichlet runs only
    assert (d["run/acc_drop_vs_mean"], d["run/suppression"], d["run/integrity"]) == pytest.approx(
        (0.45 - 0.80, 0.50 - 0.80, 0.45 - 0.50))


def test_final_accuracy_is_the_last_evaluation(report: rep.Report) -> None:
    # the step-2 evaluation is 0.1 lower; the report must take step 4's
    assert _row(report.results, "krum", "none", 0)["final_acc"] == pytest.approx(0.80)
    assert _row(report.results, "krum", "none", 0)["best_acc"] == pytest.approx(0.80)
    assert _row(report.results, "krum", "none", 0)["worst_class_acc"] == pytest.approx(0.60)


def test_tradeoff_worst_attack_and_frontier_by_hand(report: rep.Report) -> None:
    t = report.tradeoff[report.tradeoff["setting"] == "iid"].set_index("rule")
    # krum: suppression loss mean(0.90-0.80, 0.92-0.84) = 0.09; alie loss mean(0.10, 0.08) = 0.09 >
    # sign_flip loss mean(0.02, 0.04) = 0.03, so the worst attack is alie with 0.09
    assert t.loc["krum", "suppression_loss"] == pytest.approx(0.09)
    assert t.loc["krum", "integrity_loss"] == pytest.approx(0.09)
    assert t.loc["krum", "worst_attack"] == "alie"
    # coordinate median: suppression mean(0.04, 0.04) = 0.04; alie mean(0.26, 0.26) = 0.26
    assert (t.loc["coordinate_median", "suppression_loss"], t.loc["coordinate_median", "integrity_loss"]) == \
        pytest.approx((0.04, 0.26))
    # mean: no suppression by definition; sign_flip costs mean(0.80, 0.80) = 0.80 > alie's 0.40
    assert (t.loc["mean", "suppression_loss"], t.loc["mean", "integrity_loss"]) == pytest.approx((0.0, 0.80))
    assert t.loc["mean", "worst_attack"] == "sign_flip"
    # trimmed mean (0.10, 0.20) is dominated by krum (0.09, 0.09); the other three trade off
    assert t["frontier"].to_dict() == {"mean": True, "coordinate_median": True, "krum": True, "trimmed_mean": False}
    # std over the two seeds of krum's suppression loss (0.10, 0.08): sqrt(2 * 0.01^2 / 1) = 0.01414
    assert t.loc["krum", "suppression_std"] == pytest.approx(0.0141421, rel=1e-4)
    d = report.tradeoff[report.tradeoff["setting"] == "dirichlet(a=0.1)"].set_index("rule")
    assert (d.loc["krum", "suppression_loss"], d.loc["krum", "integrity_loss"]) == pytest.approx((0.30, 0.05))
    # the diverged mean/alie run is scored at chance: 0.80 - 0.10 = 0.70; krum/sign_flip was invalid
    assert d.loc["mean", "integrity_loss"] == pytest.approx(0.70) and d.loc["mean", "worst_attack"] == "alie"
    assert d.loc["krum", "worst_attack"] == "alie"


def test_skipped_and_missing_runs_are_reported_not_crashed(report: rep.Report) -> None:
    r = report.results
    bul = r[r["rule"] == "bulyan"]
    assert len(bul) == 2 and (bul["status"] == "skipped").all()
    assert bul["reason"].str.contains("n >= 4f \\+ 3", regex=True).all()
    assert bul["run/integrity"].isna().all()
    crashed = r[(r["rule"] == "krum") & (r["seed"] == 7)]
    assert crashed["status"].tolist() == ["missing"]
    assert "no final evaluation" in crashed["reason"].iloc[0]
    table = pivot(r, "final_acc", "iid")
    assert table.loc["bulyan", "alie"] == "skipped"
    assert table.loc["krum", "none"] == "82.0 ± 2.8"  # mean(80, 84); sd sqrt(2 * 2^2 / 1) = 2.83
    assert table.loc["trimmed_mean", "sign_flip"] == "—"  # never run
    assert "## Runs that did not finish" in report.markdown and "Bulyan requires" in report.markdown
    div = _row(r, "mean", "alie", 0, "dirichlet(a=0.1)")
    assert (div["status"], div["final_acc"], div["worst_class_acc"]) == ("diverged", 0.1, 0.0)
    assert div["run/integrity"] == pytest.approx(0.1 - 0.80)  # chance - the mean's clean accuracy
    assert pivot(r, "final_acc", "dirichlet(a=0.1)").loc["mean", "alie"] == "10.0 †1"
    bad = _row(r, "krum", "sign_flip", 0, "dirichlet(a=0.1)")
    assert bad["status"] == "invalid" and math.isnan(bad["run/integrity"])
    assert pivot(r, "final_acc", "dirichlet(a=0.1)").loc["krum", "sign_flip"] == "—"


def test_weights_and_label_skew(sweep: Path) -> None:
    data = load_sweep(sweep)
    runs = data.runs.set_index("run_id")
    w = data.weights.merge(runs[["rule", "attack", "seed", "heterogeneity"]], left_on="run_id", right_index=True)
    w = w[w["heterogeneity"] == "iid"]
    krum = w[(w["rule"] == "krum") & (w["attack"] == "none") & (w["seed"] == 0)].set_index("worker")
    assert len(krum) == N  # no attack: all 10 workers honest
    assert krum.loc[3, "rel_weight"] == pytest.approx(10 * 0.25)  # n * share = 2.5
    assert krum.loc[0, "rel_weight"] == 0.0
    assert krum.loc[7, "label_skew"] == pytest.approx(0.7)  # from summary.json
    attacked = w[(w["rule"] == "mean") & (w["attack"] == "alie") & (w["seed"] == 0)]
    assert sorted(attacked["worker"]) == list(range(N - F))  # only the honest ranks 0..7


def test_kappa_table_and_bounds(sweep: Path) -> None:
    data = load_sweep(sweep)
    run = data.runs[(data.runs["rule"] == "krum") & (data.runs["attack"] == "none") & (data.runs["seed"] == 0)
                    & (data.runs["heterogeneity"] == "iid")]["run_id"].iloc[0]
    assert data.kappa[data.kappa["run_id"] == run]["kappa_hat"].tolist() == [0.5, 1.0, 1.5, 2.0]
    assert data.runs.set_index("run_id").loc[run, "mean_kappa_hat"] == pytest.approx(1.25)  # (0.5+1+1.5+2)/4
    # Krum 6(1 + f/(n-2f)) = 6 * (1 + 2/6) = 8; CWMed 4(1 + 1/3)^2 = 64/9; lower bound 2/6
    assert kappa_bounds("krum", 10, 2) == pytest.approx((8.0, 1 / 3))
    assert kappa_bounds("coordinate_median", 10, 2)[0] == pytest.approx(64 / 9)
    # NNM then CWTM: (8f/(n-f)) (kappa_TM + 1), kappa_TM = (6*2/6)(1 + 1/3) = 8/3 -> 2 * 11/3 = 22/3
    assert kappa_bounds("nnm>trimmed_mean", 10, 2)[0] == pytest.approx(22 / 3)
    assert math.isnan(kappa_bounds("mean", 10, 2)[0])
    assert math.isnan(kappa_bounds("bulyan", 10, 2)[0])  # requirement fails at n=10, f=2


def test_files_written_and_figures_are_pngs(report: rep.Report) -> None:
    names = {p.name for p in report.files}
    assert {"results.csv", "tradeoff.csv", "weights.csv", "report.md", "accuracy_heatmap.png", "tradeoff.png",
            "weights_vs_skew.png", "kappa_iid.png", "learning_acc_iid.png", "learning_loss_iid.png"} <= names
    mask = os.umask(0)
    os.umask(mask)
    for p in report.files:
        assert p.exists() and p.stat().st_size > 0
        assert p.stat().st_mode & 0o666 == 0o666 & ~mask  # readable like any new file, not mkstemp's 0600
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in report.out_dir.iterdir() if p.name.endswith(".tmp")]  # no temp file left
    csv = pd.read_csv(report.out_dir / "results.csv")
    assert {"run/acc_drop_vs_mean", "run/suppression", "run/integrity", "status", "reason"} <= set(csv.columns)
    assert len(csv) == len(report.results)
    assert "| krum | 82.0 ± 2.8 |" in report.markdown


def test_learning_curves_by_hand(sweep: Path, report: rep.Report) -> None:
    data = load_sweep(sweep)
    r = report.results
    run = r[(r["rule"] == "krum") & (r["attack"] == "alie") & (r["setting"] == "iid") & (r["seed"] == 1)]["run_id"].iloc[0]
    mine = data.curves[data.curves["run_id"] == run]
    assert mine["step"].tolist() == [2, 4] and mine["acc"].tolist() == pytest.approx([0.66, 0.76])  # acc - 0.1, acc
    assert mine["loss"].tolist() == [0.5, 0.5]
    bands = curve_bands(report.results, data.curves, "iid", "acc").set_index(["rule", "attack", "step"])
    # krum under ALIE, seeds 0 and 1 end at 0.70 and 0.76: mean 0.73, band [0.70, 0.76]; at step 2, 0.1 lower
    assert bands.loc[("krum", "alie", 4), ["mean", "low", "high", "seeds"]].tolist() == pytest.approx([0.73, 0.70, 0.76, 2])
    assert bands.loc[("krum", "alie", 2), "mean"] == pytest.approx(0.63)
    assert "bulyan" not in set(bands.index.get_level_values("rule"))  # skipped runs have no curve
    assert "![learning_acc_iid.png](learning_acc_iid.png)" in report.markdown


def test_describe_run_names_pipelines_and_no_attack() -> None:
    d = describe_run(config("coordinate_median", "none", "dirichlet", 3, pre="robustagg.Bucketing"))
    assert (d["rule"], d["attack"], d["heterogeneity"], d["byzantine"], d["seed"]) == \
        ("bucketing>coordinate_median", "none", "dirichlet(a=0.1)", 0, 3)
    a = describe_run(config("krum", "alie", "iid", 0))
    b = describe_run(config("mean", "sign_flip", "iid", 0))
    c = describe_run(config("mean", "sign_flip", "iid", 1))
    assert a["context"] == b["context"] != c["context"]  # rule/attack are not context; the seed is
    assert a["setting_key"] == c["setting_key"]


def test_load_config_resolves_interpolations(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "threat: {n: 10, f: 2}\naggregator: {f: '${threat.f}'}\nlogger: {group: '${hydra:job.name}'}\n")
    (tmp_path / ".hydra" / "hydra.yaml").write_text("hydra: {job: {name: train}}\n")
    cfg = load_config(tmp_path)
    assert cfg["aggregator"]["f"] == 2 and cfg["logger"]["group"] == "train" and "hydra" not in cfg


def test_pareto_front_properties() -> None:
    assert pareto_front([1.0, 1.0], [2.0, 2.0]) == [True, True]  # ties do not dominate each other
    assert pareto_front([0.0, float("nan")], [0.0, -1.0]) == [True, False]
    assert pareto_front([], []) == []


def test_cli_and_errors(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rep.main([str(sweep), "--out", str(tmp_path / "cli"), "--wandb", "--wandb-mode", "disabled"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "| krum |" in out
    assert (tmp_path / "cli" / "report.md").exists()
    assert rep.main([str(tmp_path / "does-not-exist")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no run found"):
        rep.build_report(tmp_path / "empty")


def test_add_derived_without_a_mean_baseline() -> None:
    runs = pd.DataFrame({"run_id": ["a", "b"], "status": ["ok", "ok"], "rule": ["krum", "krum"],
                         "attack": ["none", "alie"], "final_acc": [0.8, 0.6], "context": ["c", "c"],
                         "setting_key": ["s", "s"], "setting_json": ["{}", "{}"], "heterogeneity": ["iid", "iid"],
                         "seed": [0, 0]})
    out = add_derived(runs)
    assert out["run/acc_drop_vs_mean"].isna().all() and out["run/suppression"].isna().all()
    assert out["run/integrity"].tolist() == pytest.approx([0.0, -0.2])
    assert tradeoff(out).set_index("rule").loc["krum", "integrity_loss"] == pytest.approx(0.2)


def test_no_attack_table_across_settings(report: rep.Report) -> None:
    table = across_settings(report.results, report.settings)
    assert report.settings == ["iid", "dirichlet(a=0.1)"]  # iid first
    assert table.loc["krum", "iid"] == "82.0 ± 2.8" and table.loc["krum", "dirichlet(a=0.1)"] == "50.0"
    assert table.loc["krum", "Δ dirichlet(a=0.1) (pp)"] == "-32.0"  # 50.0 - mean(80, 84)
    assert table.loc["mean", "Δ dirichlet(a=0.1) (pp)"] == "-11.0"  # 80.0 - mean(90, 92)
    assert table.loc["coordinate_median", "dirichlet(a=0.1)"] == "—"
    assert "## No attack: final test accuracy (%) across settings" in report.markdown


def test_backdoor_attack_success_rate_in_results_markdown_and_heatmap(tmp_path: Path) -> None:
    from experiments.report_figures import _with_asr

    root = tmp_path / "sweep"
    runs = {("mean", "none"): (0.90, None), ("mean", "backdoor"): (0.88, 0.90),
            ("krum", "none"): (0.80, None), ("krum", "backdoor"): (0.78, 0.10)}
    job = 0
    for (rule, attack), (acc, asr) in runs.items():
        for seed in (0, 1):
            make_run(root, job, rule, attack, "iid", seed, acc + 0.02 * seed,
                     asr=None if asr is None else asr + 0.04 * seed)
            job += 1
    r = rep.build_report(root, tmp_path / "out", wandb=False)
    assert _row(r.results, "mean", "backdoor", 1)["final_asr"] == pytest.approx(0.94)  # the last evaluation
    assert math.isnan(_row(r.results, "mean", "none", 0)["final_asr"])
    # mean over seeds (0.90, 0.94) -> 92.0 ± 2.8; (0.10, 0.14) -> 12.0 ± 2.8
    assert "### Backdoor attack success rate (%), rule × attack" in r.markdown
    assert "| mean | 92.0 ± 2.8 |" in r.markdown and "| krum | 12.0 ± 2.8 |" in r.markdown
    grid, is_asr = _with_asr(r.results, "iid")
    assert list(grid.columns) == ["none", "backdoor", "backdoor ASR"] and is_asr == [False, False, True]
    assert grid.loc["mean", "backdoor ASR"] == pytest.approx(92.0) and grid.loc["krum", "backdoor"] == pytest.approx(79.0)
    assert (tmp_path / "out" / "accuracy_heatmap.png").stat().st_size > 0


def test_no_backdoor_runs_no_asr_table_or_column(report: rep.Report) -> None:
    from experiments.report_figures import _with_asr

    assert "Backdoor attack success rate" not in report.markdown
    assert report.results["final_asr"].isna().all()
    assert not any(_with_asr(report.results, "iid")[1])
