"""Worst-case accuracy of each rule per heterogeneity setting: the lowest final test accuracy any
attack of the sweep left it (mean over seeds), the attack that did it, and the accuracy with no attack.

This is the benchmark's headline view (one number per rule and setting, the attack named in the
cell), next to the full rule x attack heatmap of :func:`experiments.report_figures.accuracy_heatmap`.
A rule's worst case is taken over the attacks that finished for it in that setting (``attacks``
counts them): compare rules only where the counts agree.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

__all__ = ["worst_case", "worst_case_heatmap", "setting_order"]

COLUMNS = ["rule", "setting", "no_attack_acc", "no_attack_std", "worst_acc", "worst_std", "worst_attack", "attacks",
           "seeds"]


def worst_case(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (rule, setting) of a report's ``results`` table (``final_acc`` as a fraction).

    Returns:
        Columns :data:`COLUMNS` (``setting`` is the heterogeneity label where the table has one, so
        that a rule whose runs carry an extra setting, FLTrust's root set, sits in the same column
        as the others): accuracies in % (mean over seeds, population standard deviation over
        seeds); ``worst_attack`` is the attack (not ``none``) with the lowest mean final accuracy,
        ties broken by attack name; ``attacks`` the number of attacks with a finished run; ``seeds``
        the number of seeds of the worst cell. Runs whose status is not ``ok`` or ``diverged`` are
        left out (skipped configurations have no accuracy).
    """
    ok = results[results["status"].isin(("ok", "diverged"))]
    rows = []
    by = "heterogeneity" if "heterogeneity" in ok.columns else "setting"
    for (rule, setting), g in ok.groupby(["rule", by], sort=True):
        cells = g.groupby("attack")["final_acc"].agg(["mean", lambda s: float(np.std(s.to_numpy())), "count"])
        cells.columns = ["mean", "std", "count"]
        none = cells.loc["none"] if "none" in cells.index else None
        attacked = cells.drop(index="none", errors="ignore")
        if len(attacked):
            worst = attacked.sort_values("mean", kind="stable").index[0]
            w = attacked.loc[worst]
        rows.append({
            "rule": rule, "setting": setting,
            "no_attack_acc": 100.0 * none["mean"] if none is not None else math.nan,
            "no_attack_std": 100.0 * none["std"] if none is not None else math.nan,
            "worst_acc": 100.0 * w["mean"] if len(attacked) else math.nan,
            "worst_std": 100.0 * w["std"] if len(attacked) else math.nan,
            "worst_attack": worst if len(attacked) else "",
            "attacks": int(len(attacked)),
            "seeds": int(w["count"]) if len(attacked) else 0,
        })
    return pd.DataFrame(rows, columns=COLUMNS)


def setting_order(table: pd.DataFrame) -> list[str]:
    """The settings of :func:`worst_case`'s table: iid first, then Dirichlet by decreasing alpha
    (more heterogeneous to the right), then the rest by name."""
    import re

    def key(s: object) -> tuple[int, float, str]:
        text = str(s)
        m = re.search(r"a=([0-9.eE+-]+)", text)
        return (0 if text.startswith("iid") else 1 if m else 2, -float(m.group(1)) if m else 0.0, text)

    return sorted(table["setting"].unique(), key=key)


def worst_case_heatmap(table: pd.DataFrame, settings: Sequence[str], rule_order: Sequence[str]) -> Any:
    """Rules (rows) x settings (columns): worst-case accuracy (%), the worst attack named in the cell.

    Args:
        table: :func:`worst_case`'s output. settings: the column order. rule_order: the row order
            (rules absent from ``table`` are left out).
    """
    import matplotlib
    import matplotlib.pyplot as plt

    rules = [r for r in rule_order if r in set(table["rule"])] + sorted(set(table["rule"]) - set(rule_order))
    values = np.full((len(rules), len(settings)), np.nan)
    labels = [["" for _ in settings] for _ in rules]
    for _, row in table.iterrows():
        if row["setting"] in settings:
            i, j = rules.index(row["rule"]), list(settings).index(row["setting"])
            values[i, j] = row["worst_acc"]
            labels[i][j] = f"{row['worst_acc']:.0f}\n{row['worst_attack']}" if row["attacks"] else "n/a"
    fig, ax = plt.subplots(figsize=(2.2 * len(settings) + 2.5, 0.42 * len(rules) + 1.6), layout="constrained")
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    image = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=100.0, aspect="auto")
    for i in range(len(rules)):
        for j in range(len(settings)):
            v = values[i, j]
            ax.text(j, i, labels[i][j] or "n/a", ha="center", va="center", fontsize=7,
                    color="white" if math.isfinite(v) and v < 60 else "black")
    ax.set_xticks(range(len(settings)), settings)
    ax.set_yticks(range(len(rules)), rules)
    ax.set_xlabel("heterogeneity")
    ax.set_title("worst-case final test accuracy (%) over attacks, worst attack named", fontsize=10)
    fig.colorbar(image, ax=ax, label="final test accuracy (%)", shrink=0.8)
    return fig
