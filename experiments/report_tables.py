"""The report's numbers: per-run integrity and suppression, the per-rule trade-off and its frontier.

Definitions (design note ``metrics.md``; accuracies are final top-1 test accuracies in [0, 1], and
"same context" means the same data, partition, model, trainer settings, n, f and seed):

- ``run/acc_drop_vs_mean`` = acc(run) - acc(mean rule, no attack, same context);
- ``run/suppression`` = acc(same rule, no attack, same context) - acc(mean rule, no attack, same
  context): what the rule throws away when nobody attacks (negative = it costs accuracy);
- ``run/integrity`` = acc(run) - acc(same rule, no attack, same context): what the attack costs
  this rule (negative = damage).

Per rule and setting (a setting is a context without the seed), the trade-off plotted by the
report uses losses, so that smaller is better on both axes:

- ``suppression_loss`` = mean over seeds of ``-run/suppression`` of the no-attack run;
- ``integrity_loss`` = max over attacks of the mean over seeds of ``-run/integrity`` (the worst
  attack on average), with ``worst_attack`` naming it.

A rule is on the *frontier* of its setting when no other rule is at least as good on both losses
and strictly better on one (Pareto-minimal).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

__all__ = ["Report", "RULE_ORDER", "ATTACK_ORDER", "BACKDOORS", "availability_table", "backdoor_table", "SCORED", "add_derived",
           "across_settings", "mean_grid", "setting_labels", "tradeoff", "pareto_front", "pivot", "to_markdown",
           "order", "slug"]

RULE_ORDER = ("mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
              "centered_clipping", "nnm>trimmed_mean", "bucketing>coordinate_median", "bucketing>krum", "bulyan",
              "caf", "smea", "monna", "cge", "dnc", "signguard", "clipped_clustering", "flame", "fltrust", "foolsgold")
ATTACK_ORDER = ("none", "sign_flip", "alie", "ipm", "min_max", "label_flip", "mimic", "agr_tailored", "opt_alie",
                "opt_ipm", "mpaf", "poisoned_fl", "backdoor", "backdoor_dba", "model_replacement")
#: The targeted (backdoor) attacks: their runs carry ``final_asr`` (the attack success rate).
BACKDOORS = ("backdoor", "backdoor_dba", "model_replacement")
#: Statuses whose ``final_acc`` enters the tables: finished runs, and diverged runs scored at chance.
SCORED = ("ok", "diverged")
_HET_KEYS = ("data.partition", "data.alpha", "data.shards_per_worker", "data.imbalance", "data.heterogeneity")


def slug(text: str) -> str:
    """A file- and key-safe form of a setting label, at most 80 characters (a longer one keeps its
    first 69 and a 10-digit hash of the whole, so distinct labels stay distinct).

    Example:
        >>> slug("dirichlet(a=0.1)")
        'dirichlet_a_0.1'
        >>> len(slug("x" * 300))
        80
    """
    import hashlib
    import re

    out = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "setting"
    if len(out) > 80:
        out = out[:69] + "_" + hashlib.sha1(text.encode()).hexdigest()[:10]
    return out


def order(values: Iterable[str], preferred: Sequence[str]) -> list[str]:
    """Unique ``values``: those in ``preferred`` first in that order, then the rest sorted.

    Example:
        >>> order(["krum", "zeta", "mean", "krum[m=2]"], ("mean", "krum"))
        ['mean', 'krum', 'krum[m=2]', 'zeta']
    """
    uniq = list(dict.fromkeys(values))

    def key(v: str) -> tuple[int, str]:
        base = v.split("[", 1)[0]
        return (preferred.index(base) if base in preferred else len(preferred), v)

    return sorted(uniq, key=key)


def setting_labels(runs: pd.DataFrame) -> pd.Series:
    """A readable label per run's setting: the heterogeneity label, plus ``key=value`` for every
    other config value that differs between the settings of the sweep (``threat.f=1``, ...)."""
    if runs.empty:
        return pd.Series(dtype=str)
    settings = {k: json.loads(s) for k, s in zip(runs["setting_key"], runs["setting_json"])}
    keys = sorted({k for s in settings.values() for k in s})
    # a key that only some settings have (a protocol's own parameters) is named only where its
    # value varies among them; a protocol by its class name
    differ = [k for k in keys if k not in _HET_KEYS and k != "protocol._target_"
              and len({json.dumps(s.get(k), default=str) for s in settings.values() if s.get(k) is not None}) > 1]
    protocols = {str(s.get("protocol._target_")) for s in settings.values()}
    labels = {}
    for sk, s in settings.items():
        het = runs.loc[runs["setting_key"] == sk, "heterogeneity"].iloc[0]
        parts = [f"protocol={str(s.get('protocol._target_')).rsplit('.', 1)[-1]}"] if len(protocols) > 1 else []
        extra = ", ".join(parts + [f"{k}={s.get(k)}" for k in differ if s.get(k) is not None])
        labels[sk] = f"{het}, {extra}" if extra else str(het)
    return runs["setting_key"].map(labels)


def add_derived(runs: pd.DataFrame) -> pd.DataFrame:
    """Add ``setting``, ``run/acc_drop_vs_mean``, ``run/suppression`` and ``run/integrity`` columns.

    Only scored runs (:data:`SCORED`: finished, or diverged and scored at chance) enter the
    references; a run whose reference is missing (e.g. the sweep has no mean/no-attack run) gets
    ``nan``. Several runs with the same (context, rule,
    attack) are averaged for the reference.
    """
    out = runs.copy()
    out["setting"] = setting_labels(out)
    scored = out["status"].isin(SCORED)
    ok = out[scored]
    base = ok[(ok["rule"] == "mean") & (ok["attack"] == "none")].groupby("context")["final_acc"].mean()
    none = ok[ok["attack"] == "none"].groupby(["context", "rule"])["final_acc"].mean()
    acc = out["final_acc"].where(scored)
    ref_mean = out["context"].map(base).astype(float)
    ref_none = pd.Series([none.get((c, r), math.nan) for c, r in zip(out["context"], out["rule"])],
                         index=out.index, dtype=float)
    out["run/acc_drop_vs_mean"] = acc - ref_mean
    out["run/suppression"] = (ref_none - ref_mean).where(scored)
    out["run/integrity"] = acc - ref_none
    return out


def pareto_front(x: Sequence[float], y: Sequence[float]) -> list[bool]:
    """Pareto-minimal points: True where no other point has ``x' <= x``, ``y' <= y`` and one strict.

    Non-finite points are never on the front and never dominate.

    Example:
        >>> pareto_front([0.0, 1.0, 2.0, 0.5], [3.0, 1.0, 1.0, 3.0])
        [True, True, False, False]
    """
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(xs) & np.isfinite(ys)
    front = []
    for i in range(len(xs)):
        if not ok[i]:
            front.append(False)
            continue
        dom = ok & (xs <= xs[i]) & (ys <= ys[i]) & ((xs < xs[i]) | (ys < ys[i]))
        front.append(not bool(dom.any()))
    return front


def tradeoff(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, rule): ``suppression_loss``, ``integrity_loss``, ``worst_attack``, their
    standard deviations over seeds, ``seeds`` and ``frontier`` (see the module docstring).

    ``runs`` must carry the columns of :func:`add_derived`.
    """
    cols = ["setting", "rule", "suppression_loss", "suppression_std", "integrity_loss", "integrity_std",
            "worst_attack", "seeds", "frontier"]
    ok = runs[runs["status"].isin(SCORED)]
    rows: list[dict[str, Any]] = []
    for (setting, rule), g in ok.groupby(["setting", "rule"], sort=False):
        clean = g[g["attack"] == "none"]["run/suppression"].dropna()
        sup = -clean.mean() if len(clean) else math.nan
        sup_std = clean.std(ddof=1) if len(clean) > 1 else math.nan
        worst, worst_loss, worst_std = "", math.nan, math.nan
        for attack, ga in g[g["attack"] != "none"].groupby("attack", sort=True):
            vals = -ga["run/integrity"].dropna()
            if len(vals) and (math.isnan(worst_loss) or vals.mean() > worst_loss):
                worst, worst_loss = str(attack), float(vals.mean())
                worst_std = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
        rows.append({"setting": setting, "rule": rule, "suppression_loss": sup, "suppression_std": sup_std,
                     "integrity_loss": worst_loss, "integrity_std": worst_std, "worst_attack": worst,
                     "seeds": int(g["seed"].nunique()), "frontier": False})
    table = pd.DataFrame.from_records(rows, columns=cols)
    for setting, g in table.groupby("setting", sort=False):
        table.loc[g.index, "frontier"] = pareto_front(g["suppression_loss"].tolist(), g["integrity_loss"].tolist())
    if len(table):
        rank = {r: i for i, r in enumerate(order(table["rule"], RULE_ORDER))}
        table = table.sort_values(["setting", "rule"], key=lambda s: s.map(rank) if s.name == "rule" else s)
    return table.reset_index(drop=True)


def pivot(runs: pd.DataFrame, value: str, setting: str, *, scale: float = 100.0,
          digits: int = 1) -> pd.DataFrame:
    """Rule x attack table of ``value`` for one setting, cells ``"mean ± std"`` over seeds (times
    ``scale``), with ``†k`` when k of those runs diverged (scored at chance), ``"skipped"`` where
    every run was skipped, ``"—"`` where none finished."""
    sub = runs[runs["setting"] == setting]
    rules = order(sub["rule"], RULE_ORDER)
    attacks = order(sub["attack"], ATTACK_ORDER)
    table = pd.DataFrame(index=rules, columns=attacks, dtype=object)
    for r in rules:
        for a in attacks:
            cell = sub[(sub["rule"] == r) & (sub["attack"] == a)]
            vals = cell.loc[cell["status"].isin(SCORED), value].dropna() * scale
            div = int((cell["status"] == "diverged").sum())
            mark = f" †{div}" if div else ""
            if len(vals) == 0:
                table.loc[r, a] = "skipped" if len(cell) and (cell["status"] == "skipped").all() else "—"
            elif len(vals) == 1:
                table.loc[r, a] = f"{vals.iloc[0]:.{digits}f}{mark}"
            else:
                table.loc[r, a] = f"{vals.mean():.{digits}f} ± {vals.std(ddof=1):.{digits}f}{mark}"
    table.index.name = "rule"
    return table


def across_settings(runs: pd.DataFrame, settings: Sequence[str], *, attack: str = "none", value: str = "final_acc",
                    scale: float = 100.0, digits: int = 1) -> pd.DataFrame:
    """Rule x setting table of ``value`` for one attack (default: no attack, i.e. suppression at a
    glance), cells ``"mean ± std"`` over seeds as in :func:`pivot`, plus, per setting after the
    first, the change against the first setting in points (``Δ <setting>``)."""
    sub = runs[(runs["attack"] == attack)]
    rules = order(sub["rule"], RULE_ORDER)
    table = pd.DataFrame(index=rules, dtype=object)
    means: dict[str, pd.Series] = {}
    for setting in settings:
        col = pivot(sub, value, setting, scale=scale, digits=digits)
        table[setting] = col[attack].reindex(rules).fillna("—") if attack in col.columns else "—"
        ok = sub[(sub["setting"] == setting) & (sub["status"].isin(SCORED))]
        means[setting] = ok.groupby("rule")[value].mean().reindex(rules) * scale
    for setting in list(settings)[1:]:
        delta = means[setting] - means[settings[0]]
        table[f"Δ {setting} (pp)"] = [f"{v:+.{digits}f}" if math.isfinite(v) else "—" for v in delta]
    table.index.name = "rule"
    return table


def backdoor_table(runs: pd.DataFrame, setting: str) -> "pd.DataFrame | None":
    """Rule x backdoor-attack table of the attack success rate (%) for one setting (as :func:`pivot`),
    restricted to the attacks of the setting whose runs logged ``final_asr``; ``None`` when there are none."""
    sub = runs[runs["setting"] == setting]
    if "final_asr" not in sub:
        return None
    has = sub.groupby("attack")["final_asr"].apply(lambda v: bool(v.notna().any()))
    names = [a for a in order(sub["attack"], ATTACK_ORDER) if has.get(a, False)]
    if not names:
        return None
    return pivot(sub[sub["attack"].isin(names)], "final_asr", setting)


AVAILABILITY_COLUMNS = [("mean_bias_vs_sync", "bias"), ("mean_bias_vs_sync_rel", "rel. bias"),
                        ("mean_kappa_hat", "κ̂"), ("mean_staleness", "staleness"),
                        ("rounds_without_guarantee", "rounds over f"), ("final_acc", "acc (%)")]


def availability_table(runs: pd.DataFrame) -> "pd.DataFrame | None":
    """Attack x rule x protocol x participation x τ table of the bias against the synchronous
    full-participation honest mean (``agg/bias_vs_sync``, its relative form, κ̂, staleness, rounds
    with more sampled Byzantine clients than f, final accuracy in %), means over the finished runs'
    seeds; ``None`` when no run measured the bias (not an availability sweep)."""
    if "mean_bias_vs_sync" not in runs or not runs["mean_bias_vs_sync"].notna().any():
        return None
    ok = runs[runs["status"].isin(SCORED) & runs["mean_bias_vs_sync"].notna()].copy()
    keys = ["attack", "rule", "protocol", "participation", "tau"]
    for k in ("participation", "tau"):
        ok[k] = ok[k].map(lambda v: "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v)
    cols = [(c, name) for c, name in AVAILABILITY_COLUMNS if c in ok]
    table = ok.groupby(keys, sort=False)[[c for c, _ in cols]].mean()
    if "final_acc" in table:
        table["final_acc"] = table["final_acc"] * 100.0
    table["seeds"] = ok.groupby(keys, sort=False)["seed"].nunique()
    table = table.rename(columns=dict(cols)).reset_index()
    rank = {a: i for i, a in enumerate(order(table["attack"], ATTACK_ORDER))}
    rule_rank = {r: i for i, r in enumerate(order(table["rule"], RULE_ORDER))}
    table = table.sort_values(["attack", "rule", "protocol", "participation", "tau"],
                              key=lambda col: col.map(rank) if col.name == "attack" else
                              col.map(rule_rank) if col.name == "rule" else col.astype(str), kind="stable")
    return table.reset_index(drop=True)


def mean_grid(runs: pd.DataFrame, value: str, setting: str) -> pd.DataFrame:
    """Rule x attack float table of the mean of ``value`` over the finished runs of one setting
    (``nan`` where none finished)."""
    sub = runs[(runs["setting"] == setting)]
    rules = order(sub["rule"], RULE_ORDER)
    attacks = order(sub["attack"], ATTACK_ORDER)
    ok = sub[sub["status"].isin(SCORED)]
    grid = ok.groupby(["rule", "attack"])[value].mean().unstack()
    return grid.reindex(index=rules, columns=attacks).astype(float)


def to_markdown(df: pd.DataFrame, *, index: bool = True, floatfmt: str = ".3g") -> str:
    """A GitHub-flavoured Markdown table of ``df`` (no extra dependency); ``|`` in cells is escaped."""

    def cell(v: Any) -> str:
        if isinstance(v, (bool, np.bool_)):
            return "yes" if v else ""
        if isinstance(v, (float, np.floating)):
            return "—" if not math.isfinite(float(v)) else format(float(v), floatfmt)
        return str(v).replace("|", "\\|")

    head = ([str(df.index.name or "")] if index else []) + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for idx, row in df.iterrows():
        vals = ([cell(idx)] if index else []) + [cell(v) for v in row.tolist()]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


@dataclass
class Report:
    """What :func:`build_report` produced.

    Attributes:
        out_dir: where the files went. results: the per-run table (``results.csv``).
        tradeoff: per setting and rule (``tradeoff.csv``). settings: the setting labels, in order.
        files: every file written. markdown: the text of ``report.md``.
    """

    out_dir: Path
    results: pd.DataFrame
    tradeoff: pd.DataFrame
    settings: list[str]
    files: list[Path] = field(default_factory=list)
    markdown: str = ""
