"""The numbers the prose of docs/results.md and README.md quotes are the committed result files'.

The generated tables are checked by tests/test_results_page.py; this module checks the sentences
around them: each number is computed here from its committed file and looked up, as the page
writes it, in the page's text (so a stale sentence or an edited file fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    """``text`` with its line breaks and runs of spaces made one space (sentences wrap anywhere)."""
    return " ".join(text.split())


def _acc(name: str) -> pd.DataFrame:
    """Final accuracy (%) per (rule, attack) of a committed reproduction: mean and std over seeds."""
    t = pd.read_csv(RESULTS / name / "results.csv")
    return t[t["status"] == "ok"].groupby(["rule", "attack"])["final_acc"].agg(["mean", "std"]) * 100


def _in(text: str, *phrases: str) -> None:
    flat = _flat(text)
    for phrase in phrases:
        assert phrase in flat, f"not on the page: {phrase!r}"


def test_the_readme_fashion_mnist_paragraph_is_the_committed_tour():
    rows = {(r["rule"], r["attack"]): r for r in json.loads((RESULTS / "tour_fmnist.json").read_text())}

    def acc(rule: str, attack: str) -> str:
        return f"{rows[(rule, attack)]['final_test_acc']:.3f}"

    _in(README, f"breaks the mean ({acc('mean', 'none')} to {acc('mean', 'gaussian')}, a class lost)",
        f"barely moves the trimmed mean ({acc('trimmed_mean', 'none')} to {acc('trimmed_mean', 'gaussian')})",
        f"({acc('mean', 'none')} to {acc('mean', 'alie')} against {acc('trimmed_mean', 'none')} to "
        f"{acc('trimmed_mean', 'alie')})",
        f"(κ̂ {rows[('trimmed_mean', 'alie')]['mean_kappa_hat']:.3f} against the mean's "
        f"{rows[('mean', 'alie')]['mean_kappa_hat']:.4f})",
        f"(worst class {rows[('trimmed_mean', 'alie')]['worst_class_acc']:.3f} against "
        f"{rows[('mean', 'alie')]['worst_class_acc']:.3f})")
    assert rows[("mean", "gaussian")]["worst_class_acc"] == 0.0  # "a class lost"
    drop = {r: float(acc(r, "none")) - float(acc(r, "alie")) for r in ("mean", "trimmed_mean")}
    assert drop["mean"] > drop["trimmed_mean"]  # "costs the mean ... more final accuracy"


def test_the_fang_verdict_is_the_committed_sweep():
    a = _acc("repro_fang2020_fmnist")["mean"]
    assert (round(a[("krum", "none")]), round(a[("krum", "fang_krum")])) == (81, 29)
    assert (round(1 - a[("krum", "none")] / 100, 2), round(1 - a[("krum", "fang_krum")] / 100, 2)) == (0.19, 0.71)
    assert round(a[("trimmed_mean", "none")] - a[("trimmed_mean", "fang_trimmed_mean")]) == 6
    assert round(a[("coordinate_median", "none")] - a[("coordinate_median", "fang_trimmed_mean")]) == 2
    krum_attack_cost = max(a[(r, "none")] - a[(r, "fang_krum")] for r in ("trimmed_mean", "coordinate_median"))
    assert krum_attack_cost <= 2.5  # "at most about 2 points"
    _in(PAGE, "from about 81 % to about 29 % (error about 0.19 to about 0.71)",
        "costs the trimmed mean about 6 points and the median about 2", "at most about 2 points")


def test_the_fang_full_size_paragraph_is_the_committed_runs():
    folder = RESULTS / "repro_fang2020_fmnist_full"
    runs = pd.read_csv(folder / "results.csv").set_index("attack")
    acc = runs["final_acc"] * 100
    curves = pd.read_csv(folder / "curves.csv").merge(runs.reset_index()[["run_id", "attack"]], on="run_id")
    c = curves.pivot_table(index="step", columns="attack", values="acc") * 100
    gap = (c["none"] - c["fang_trimmed_mean"]).round(1)
    wall = sorted(runs["wall_seconds"])
    _in(PAGE, f"took {wall[0]:,.0f} and {wall[1]:,.0f} s of wall time ({wall[0] / 60:.0f} and {wall[1] / 60:.0f} minutes",
        f"costs the trimmed mean {acc['none'] - acc['fang_trimmed_mean']:.1f} points "
        f"({acc['none']:.1f} % to {acc['fang_trimmed_mean']:.1f} %)",
        f"({c.loc[250, 'fang_trimmed_mean']:.1f} % against {c.loc[250, 'none']:.1f} % at step 250, "
        f"{c.loc[500, 'fang_trimmed_mean']:.1f} % against {c.loc[500, 'none']:.1f} % at step 500)",
        f"the gap is {gap[1250]:.1f} points at steps 1,250 and 1,500",
        f"{gap[gap.index >= 1750].min():.1f} to {gap[gap.index >= 1750].max():.1f} points from step 1,750 on")
    assert gap[1250] == gap[1500] and gap.idxmax() == 250  # "most early"


def test_the_shejwalkar_verdict_is_the_committed_sweep():
    a = _acc("repro_shejwalkar2021_fmnist")
    m = a["mean"]
    attacks = ("agr_tailored", "min_max", "min_sum")
    costs = [m[(r, "none")] - m[(r, k)] for r in ("coordinate_median", "trimmed_mean") for k in attacks]
    assert (round(min(costs)), round(max(costs))) == (22, 32)
    strongest = {r: min(attacks, key=lambda k: m[(r, k)]) for r in ("coordinate_median", "trimmed_mean",
                                                                     "multi_krum", "bulyan")}
    assert strongest == {"coordinate_median": "agr_tailored", "trimmed_mean": "min_sum", "multi_krum": "min_sum",
                         "bulyan": "min_max"}
    assert max(abs(m[("krum", "none")] - m[("krum", k)]) for k in attacks) < 3 and round(m[("krum", "none")]) == 77
    assert round(a["std"].loc[[(r, k) for r in a.index.levels[0] for k in ("min_max", "min_sum")]].max()) == 14
    _in(PAGE, "cost the median and the trimmed mean 22 to 32 points", "within 3 points of its no-attack level (about 77 %",
        "Spreads of up to 14 points under min-max and min-sum")


@pytest.mark.parametrize("name", ["repro_fang2020_fmnist", "repro_fltrust2021_fmnist", "repro_shejwalkar2021_fmnist",
                                  "repro_allouah2023_fmnist"])
def test_every_reproduction_cell_has_three_seeds(name):
    """The page's "over at least 3 seeds": every (rule, setting, attack) cell holds seeds 0, 1 and 2."""
    t = pd.read_csv(RESULTS / name / "results.csv")
    seeds = t[t["status"] == "ok"].groupby(["rule", "setting", "attack"])["seed"].apply(lambda s: sorted(s))
    assert len(seeds) and all(s == [0, 1, 2] for s in seeds), seeds[seeds.map(lambda s: s != [0, 1, 2])]


def test_the_benchmark_skips_and_divergences_are_what_the_page_says():
    t = pd.read_csv(RESULTS / "fmnist_benchmark" / "results.csv")
    bulyan = t[t["rule"] == "bulyan"]
    assert len(bulyan) and (bulyan["status"] == "skipped").all()
    assert bulyan["reason"].str.contains("n >= 4f \\+ 3", regex=True).all() and set(bulyan["n"]) == {10}
    diverged = t[t["status"] == "diverged"]
    assert set(diverged["rule"]) == {"mean"} and set(diverged["attack"]) == {"agr_tailored", "opt_alie", "opt_ipm"}
    assert (diverged["final_acc"] == 0.1).all() and diverged["steps"].max() < 12
    _in(PAGE, "needs n ≥ 4f + 3 = 11 workers and the grid has 10", "non-finite submissions by step 12")


def _full(name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A larger-size reproduction's runs (by attack) and its curves (% by step x attack)."""
    runs = pd.read_csv(RESULTS / name / "results.csv")
    curves = pd.read_csv(RESULTS / name / "curves.csv").merge(runs[["run_id", "attack"]], on="run_id")
    return runs.set_index("attack"), curves.pivot_table(index="step", columns="attack", values="acc") * 100


def test_the_fltrust_full_size_paragraph_is_the_committed_runs():
    runs, c = _full("repro_fltrust2021_fmnist_full")
    acc = runs["final_acc"] * 100
    gap = (c["none"] - c["fang_trimmed_mean"]).round(1)
    scaled = _acc("repro_fltrust2021_fmnist")["mean"]
    wall = sorted(runs["wall_seconds"])
    _, fang = _full("repro_fang2020_fmnist_full")
    _in(PAGE, f"took {wall[0]:,.0f} and {wall[1]:,.0f} s of wall time ({wall[0] / 60:.0f} and {wall[1] / 60:.0f} minutes",
        f"costs FLTrust {acc['none'] - acc['fang_trimmed_mean']:.1f} points ({acc['none']:.1f} % to "
        f"{acc['fang_trimmed_mean']:.1f} %), against "
        f"{scaled[('fltrust', 'none')] - scaled[('fltrust', 'fang_trimmed_mean')]:.1f} at the scaled size",
        f"between {gap[gap.index >= 250].min():.1f} and {gap[gap.index >= 250].max():.1f} points from step 250 on",
        f"below the scaled sweep's {scaled[('fltrust', 'none')]:.0f} %",
        f"({c.loc[1750, 'none']:.1f} % to {c.loc[2000, 'none']:.1f} % over the last 250 steps",
        f"stood at {fang.loc[2000, 'none']:.1f} %")
    assert round(scaled[("fltrust", "none")] - acc["none"]) == 11  # "about 11 points below"
    assert set(runs["rule"]) == {"fltrust"} and set(runs["n"]) == {100} and set(runs["seed"]) == {0}


def _worst() -> pd.DataFrame:
    return pd.read_csv(RESULTS / "fmnist_benchmark" / "worst_case.csv").set_index(["rule", "setting"])


def test_the_benchmark_suppression_paragraph_is_the_committed_grid():
    w = _worst().xs("dirichlet(a=0.1)", level="setting")
    acc, std = w["no_attack_acc"], w["no_attack_std"]
    _in(PAGE, f"({acc['coordinate_median']:.0f} % and {acc['krum']:.0f} % against the mean's {acc['mean']:.0f} %, "
              f"with spreads of {std['coordinate_median']:.0f} and {std['krum']:.0f} points over the three seeds)",
        f"The trimmed mean ({acc['trimmed_mean']:.0f} %), the bucketed median ({acc['bucketing>coordinate_median']:.0f} %)",
        f"ClippedClustering ({acc['clipped_clustering']:.0f} %)")
    some = ["monna", "multi_krum", "smea"]
    assert {round(acc[r]) for r in some} == {77} and {round(std[r]) for r in some} == {4, 5}  # "77 %, spreads of 4 to 5"
    named = {"coordinate_median", "krum", "trimmed_mean", "bucketing>coordinate_median", "clipped_clustering", "mean",
             *some}
    others = acc.drop(list(named))
    assert (acc["mean"] - others).max() < 5 and (round(others.min()), round(others.max())) == (78, 83)
    assert (acc["mean"] - acc[list(named - {"mean"})]).min() >= 5 - 0.05  # the named ones give up 5 points or more


ATTACK_WORDS = {"opt_ipm": "the optimised IPM", "opt_alie": "the optimised ALIE", "agr_tailored": "AGR-tailored",
                "min_max": "min-max", "label_flip": "label flipping", "alie": "ALIE", "mpaf": "MPAF",
                "sign_flip": "sign flipping"}
SEED_WORDS = {1: "one seed", 2: "two seeds", 3: "three seeds"}


def test_the_benchmark_integrity_paragraph_is_the_committed_grid():
    w = _worst()
    search = {"agr_tailored", "min_max", "opt_alie", "opt_ipm"}
    cc = w.xs("centered_clipping", level="rule")
    mean = w.xs("mean", level="rule")
    assert set(cc["worst_attack"]) == {"opt_ipm"} and (cc["worst_acc"] < 10).all()  # below chance, 1/10
    assert set(mean["worst_attack"]) == {"agr_tailored"} and set(mean["worst_acc"]) == {10.0}
    a = w.xs("dirichlet(a=0.1)", level="setting")

    def said(rule: str) -> str:
        r = a.loc[rule]
        return f"{r['worst_acc']:.0f} % ({ATTACK_WORDS[r['worst_attack']]}, {SEED_WORDS[int(r['seeds'])]})"

    others = a.drop(["fltrust", "signguard", "flame", "foolsgold", "mean"])["worst_acc"]
    _in(PAGE, f"are the worst case of {int(w['worst_attack'].isin(search).sum())} of the {len(w)} rule × setting cells",
        f"*below* chance ({cc['worst_acc'].min():.1f} to {cc['worst_acc'].max():.1f} %) in all three settings",
        f"At α = 0.1 FLTrust's worst case is {said('fltrust')}", f"SignGuard's {said('signguard')}",
        f"FLAME's {said('flame')}", f"FoolsGold's {said('foolsgold')}",
        f"every other rule's {others.max():.1f} % or less ({others.idxmax()})")
    assert (a.loc[["fltrust", "signguard", "flame", "foolsgold"], "worst_acc"] > others.max()).all()


def test_the_status_row_counts_are_the_committed_grid():
    t = pd.read_csv(RESULTS / "fmnist_benchmark" / "results.csv")
    per_seed = t.groupby("seed").size()
    search = ["agr_tailored", "opt_alie", "opt_ipm"]
    rules = t["rule"].nunique()
    assert rules == 20 and t["attack"].nunique() == 15
    assert per_seed[0] == per_seed[1] == 20 * 15 * 3  # every rule, every attack, every setting
    s2 = t[t["seed"] == 2]
    assert len(s2) == 20 * 12 * 3 and not s2["attack"].isin(search).any()
    _in(PAGE, f"{len(t):,} of its 2,700 runs", f"seeds 0 and 1 for every rule and every attack ({per_seed[0] + per_seed[1]:,} runs)",
        f"seed 2 for every rule with no attack and against the 11 attacks that do not search against the rule "
        f"({len(s2):,} runs)")
