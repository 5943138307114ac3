"""The integrity-vs-suppression sweep configs, and the quick sweep + report end to end.

Fast tests compose every experiment and rule-choice config with Hydra's compose API and validate
it with the trainer's own checks; the slow test runs the quick sweep as a user would
(``python -m experiments.train -m +experiment=integrity_vs_suppression_quick``), then the report,
and checks the report's numbers against the runs' own ``summary.json`` files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

os.environ.setdefault("WANDB_MODE", "disabled")

import experiments.config  # noqa: E402,F401  (registers the structured-config schema train_schema)
from robustagg.errors import AssumptionError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
RULE_FILES = sorted(p.stem for p in (CONF / "experiment" / "rule").glob("*.yaml"))
EXPECTED_RULE = {"mean": "mean", "coordinate_median": "coordinate_median", "trimmed_mean": "trimmed_mean",
                 "krum": "krum", "multi_krum": "multi_krum", "geometric_median": "geometric_median",
                 "centered_clipping": "centered_clipping", "centered_clipping_tau03": "centered_clipping",
                 "nnm_trimmed_mean": "nnm>trimmed_mean", "nnm_krum": "nnm>krum",
                 "nnm_geometric_median": "nnm>geometric_median", "bucketing_coordinate_median": "bucketing>coordinate_median",
                 "bucketing_krum": "bucketing>krum", "bulyan": "bulyan",
                 **{r: r for r in ("caf", "smea", "monna", "cge", "dnc", "signguard", "clipped_clustering", "flame",
                                   "fltrust", "foolsgold")}}


def _compose(overrides: list[str], hydra_cfg: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_cfg)


def _sweep_params(experiment: str) -> dict[str, list[str]]:
    cfg = _compose([f"+experiment={experiment}"], hydra_cfg=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert isinstance(params, dict)
    return {str(k): str(v).split(",") for k, v in params.items()}


@pytest.mark.parametrize("experiment, runs", [("integrity_vs_suppression", 20 * 15 * 2 * 3),
                                              ("integrity_vs_suppression_quick", 5 * 3 * 2 * 1),
                                              ("literature_bucketing", 7 * 2 * 5),
                                              ("allouah2023_mnist", 4 * 2 * 3 * 2), ("cifar10_resnet20", 2 * 2 * 2),
                                              ("repro_fang2020_fmnist", 3 * 3 * 3), ("repro_fang2020_fmnist_full", 2),
                                              ("repro_fltrust2021_fmnist", 5 * 5 * 3), ("repro_fltrust2021_fmnist_full", 2),
                                              ("repro_allouah2023_fmnist", 6 * 5 * 3 * 3),
                                              ("repro_allouah2023_fmnist_full", 2),
                                              ("repro_shejwalkar2021_fmnist", 5 * 4 * 3),
                                              ("repro_shejwalkar2021_fmnist_full", 2)])
def test_sweep_sizes_and_names(experiment: str, runs: int) -> None:
    params = _sweep_params(experiment)
    assert math.prod(len(v) for v in params.values()) == runs
    assert set(params["+experiment/rule"]) <= set(RULE_FILES)
    for attack in params.get("attack", []):
        assert (CONF / "attack" / f"{attack}.yaml").exists(), attack
    for attack in params.get("+experiment/attack", []):
        assert (CONF / "experiment" / "attack" / f"{attack}.yaml").exists(), attack


def test_full_sweep_matches_the_issue() -> None:
    params = _sweep_params("integrity_vs_suppression")
    rules = {EXPECTED_RULE[r] for r in params["+experiment/rule"]}
    assert rules == {"mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
                     "centered_clipping", "nnm>trimmed_mean", "bucketing>coordinate_median", "bulyan", "caf", "smea",
                     "monna", "cge", "dnc", "signguard", "clipped_clustering", "flame", "fltrust", "foolsgold"}
    assert params["attack"] == ["none", "sign_flip", "alie", "ipm", "min_max", "label_flip", "mimic", "agr_tailored",
                                "opt_alie", "opt_ipm", "mpaf", "poisoned_fl", "backdoor", "backdoor_dba",
                                "model_replacement"]
    assert params["data.partition"] == ["iid", "dirichlet"]
    cfg = _compose(["+experiment=integrity_vs_suppression"], hydra_cfg=True)
    assert cfg.data.name == "digits" and cfg.data.alpha == 0.1 and cfg.trainer.mode == "simulated"
    assert "joblib" in cfg.hydra.launcher._target_.lower()


@pytest.mark.parametrize("rule_file", RULE_FILES)
def test_every_rule_choice_composes_and_validates(rule_file: str, tmp_path: Path) -> None:
    from experiments.wiring import validate

    cfg = _compose(["+experiment=integrity_vs_suppression", f"+experiment/rule={rule_file}", "attack=alie"])
    if rule_file in ("bulyan", "bucketing_krum"):  # n = 10, f = 2 breaks their requirement: skipped in sweeps
        with pytest.raises(AssumptionError, match=r"requires n >= (4f \+ 3|2f \+ 3)"):
            validate(cfg, out_dir=str(tmp_path))
        return
    plan = validate(cfg, out_dir=str(tmp_path))
    assert plan.rule_name == EXPECTED_RULE[rule_file]
    assert plan.attack_name == "alie" and plan.n == 10 and plan.f == 2


def test_literature_config_is_valid_for_bucketing_krum(tmp_path: Path) -> None:
    from experiments.wiring import validate

    cfg = _compose(["+experiment=literature_bucketing", "+experiment/rule=bucketing_krum", "data.partition=label_sorted"])
    plan = validate(cfg, out_dir=str(tmp_path))
    assert plan.rule_name == "bucketing>krum" and plan.byzantine_ranks == () and plan.f == 1
    tau = _compose(["+experiment=literature_bucketing", "+experiment/rule=centered_clipping_tau03"])
    assert tau.aggregator.tau == 0.3


def test_wandb_runs_carry_the_sweep_group() -> None:
    cfg = _compose(["+experiment=integrity_vs_suppression_quick", "logger=wandb"])
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "offline"
    assert cfg.logger.group == "integrity_vs_suppression_quick"
    assert _compose(["+experiment=integrity_vs_suppression", "logger=wandb"]).logger.group == "integrity_vs_suppression"


@pytest.mark.parametrize("launcher, target", [("local", "JoblibLauncher"), ("slurm", "SlurmLauncher"),
                                              ("basic", "BasicLauncher")])
def test_launcher_configs_compose(launcher: str, target: str) -> None:
    cfg = _compose(["+experiment=integrity_vs_suppression_quick", f"hydra/launcher={launcher}"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "local":
        assert cfg.hydra.launcher.n_jobs == 2
    elif launcher == "slurm":
        assert cfg.hydra.launcher.cpus_per_task == 1 and cfg.hydra.launcher.timeout_min == 30


@pytest.mark.slow
def test_quick_sweep_and_report_end_to_end(tmp_path: Path) -> None:
    from experiments.report import build_report

    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    # A 12-cell slice of the quick sweep (its 30 cells are checked by test_sweep_sizes_and_names):
    # the baseline, a pre-aggregation pipeline and the skipped Bulyan, clean and attacked, both
    # partitions. The command-line lists replace the experiment's sweeper lists, as a user's would.
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "-m", "+experiment=integrity_vs_suppression_quick",
                           "+experiment/rule=mean,bucketing_coordinate_median,bulyan", "attack=none,sign_flip",
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = build_report(sweep, wandb=False)
    r = report.results
    assert len(r) == 12
    assert (r["status"] == "ok").sum() == 8
    skipped = r[r["status"] == "skipped"]
    assert len(skipped) == 4 and set(skipped["rule"]) == {"bulyan"}
    assert skipped["reason"].str.contains(r"Bulyan requires n >= 4f \+ 3").all()
    # Independent recomputation from the runs' own summary.json and resolved config
    acc: dict[tuple[str, str, str], float] = {}
    for d in sweep.iterdir():
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            c = yaml.safe_load((d / "config_resolved.yaml").read_text())
            acc[(s["rule"], s["attack"], c["data"]["partition"])] = s["final_test_acc"]
    assert len(acc) == 8
    ok = r[r["status"] == "ok"]
    for _, row in ok.iterrows():
        part = "iid" if row["heterogeneity"] == "iid" else "dirichlet"
        assert row["final_acc"] == pytest.approx(acc[(row["rule"], row["attack"], part)])
        mean_clean = acc[("mean", "none", part)]
        rule_clean = acc[(row["rule"], "none", part)]
        assert row["run/suppression"] == pytest.approx(rule_clean - mean_clean)
        assert row["run/integrity"] == pytest.approx(row["final_acc"] - rule_clean)
        assert row["run/acc_drop_vs_mean"] == pytest.approx(row["final_acc"] - mean_clean)
    assert acc[("mean", "none", "iid")] > 0.8  # the baseline learns digits in 60 steps
    assert acc[("mean", "sign_flip", "iid")] < acc[("mean", "none", "iid")]  # the mean is not robust
    # label skew: Dirichlet(0.1) workers are far more skewed than iid ones
    w = report.results[["run_id", "heterogeneity"]].merge(
        json_weights(report.out_dir / "weights.csv"), on="run_id")
    skew = w.groupby("heterogeneity")["label_skew"].mean()
    assert skew["dirichlet(a=0.1)"] > 2 * skew["iid"]
    names = {p.name for p in report.files}
    assert {"results.csv", "tradeoff.csv", "report.md", "accuracy_heatmap.png", "tradeoff.png", "weights_vs_skew.png",
            "kappa_iid.png", "kappa_dirichlet_a_0.1.png"} <= names
    assert "### Final test accuracy (%), rule × attack" in report.markdown


def json_weights(path: Path):
    import pandas as pd

    return pd.read_csv(path)[["run_id", "worker", "label_skew", "rel_weight"]].astype({"run_id": str})
