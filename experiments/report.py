"""Report of a sweep: ``python -m experiments.report <multirun dir>``.

Reads every run of a Hydra multirun folder (resolved config, ``metrics.jsonl``, ``summary.json``,
``skipped.json``; see :mod:`experiments.report_load`), computes integrity and suppression
(:mod:`experiments.report_tables`, design note ``metrics.md``) and writes, into ``<dir>/report``
(or ``--out``), every file atomically (temp file, fsync, rename):

- ``results.csv``: one row per run with ``run/acc_drop_vs_mean``, ``run/suppression``,
  ``run/integrity`` and the run's status (``ok``, ``skipped`` with the reason, ``missing``);
- ``tradeoff.csv``: per setting and rule, the suppression and integrity losses, the worst attack
  and whether the rule is on the Pareto frontier;
- ``weights.csv``: each honest worker's mean weight in the aggregate and its label skew;
- ``report.md``: the tables (final accuracy rule x attack, the trade-off, worst-class accuracy,
  skipped runs) and the figures;
- ``worst_case.csv`` and ``worst_case_heatmap.png``: each rule's lowest accuracy over the attacks per
  setting, the attack named (:mod:`experiments.report_worstcase`);
- ``accuracy_heatmap.png``, ``tradeoff.png``, ``kappa_<setting>.png``, ``weights_vs_skew.png``,
  ``learning_acc_<setting>.png`` and ``learning_loss_<setting>.png`` (learning curves: a panel per
  rule, a line per attack, the seeds as a band); ``--format pdf`` or ``--format svg`` writes them
  as PDF or SVG instead (vector figures for a paper).

With ``--wandb`` (or when the sweep's runs logged to W&B), the tables (``wandb.Table``) and images
are also logged to a run named ``report`` in the sweep's W&B group (offline unless
``WANDB_MODE``/``--wandb-mode`` says otherwise).

Example::

    python -m experiments.train -m +experiment=integrity_vs_suppression_quick
    python -m experiments.report multirun/integrity_vs_suppression_quick/2024-01-01_12-00-00
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from robustagg.errors import ConfigError

from .report_figures import (accuracy_heatmap, availability_vs_bias, kappa_curves, learning_curves, save_figure,
                             tradeoff_scatter, weight_vs_skew)
from .report_load import SweepData, load_sweep, write_atomic
from .report_style import FIGURE_FORMATS
from .report_tables import (RULE_ORDER, SCORED, Report, across_settings, add_derived, availability_table,
                            backdoor_table, order, pivot, slug, to_markdown, tradeoff)
from .report_worstcase import setting_order, worst_case, worst_case_heatmap

__all__ = ["Report", "build_report", "redraw", "write_text", "write_csv", "main"]

RESULT_COLUMNS = ["run_id", "status", "rule", "attack", "setting", "heterogeneity", "data", "seed", "n", "f",
                  "byzantine", "final_acc", "final_asr", "best_acc", "worst_class_acc", "final_loss",
                  "run/acc_drop_vs_mean", "run/suppression", "run/integrity", "mean_kappa_hat", "byz_accepted", "steps",
                  "protocol", "participation", "tau", "mean_bias_vs_sync", "mean_bias_vs_sync_rel", "mean_staleness",
                  "rounds_without_guarantee",
                  "wall_seconds", "reason", "run_dir"]


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    return write_atomic(path, write)


def write_csv(path: Path, df: pd.DataFrame) -> Path:
    """Write ``df`` as CSV (no index) to ``path`` atomically."""
    return write_atomic(path, lambda tmp: df.to_csv(tmp, index=False))


def replace_folder(staged: Path, dest: Path) -> Path:
    """Put the folder ``staged`` (complete, written elsewhere) in place of ``dest`` as a whole."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(staged, dest)
    return dest


def _pp(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{round(100.0 * v, 1) + 0.0:+.1f}"


def _counts(results: pd.DataFrame) -> str:
    counts = results["status"].value_counts()
    parts = [f"{int(counts.get(k, 0))} {k}" for k in ("ok", "skipped", "diverged", "invalid", "failed", "missing")
             if counts.get(k, 0) or k in ("ok", "skipped")]
    return f"{len(results)} runs: " + ", ".join(parts)


def _empty_column_notes(sub: pd.DataFrame) -> list[str]:
    """Why a trade-off column of one setting's runs ``sub`` is empty: the runs it compares with
    are not in the sweep (``attack=none`` of the same rule; the mean rule with ``attack=none``)."""
    scored = sub[sub["status"].isin(SCORED)]
    clean = set(scored.loc[scored["attack"] == "none", "rule"])
    rules = order(scored["rule"], RULE_ORDER)
    lacking = [r for r in rules if r not in clean]
    notes = []
    if lacking:
        notes.append(f"Empty integrity and suppression losses for {', '.join(lacking)}: each needs an attack=none "
                     "run in the sweep (the same rule, data and seed without an attack); add `none` to the sweep's "
                     "attack list.")
    if rules and "mean" not in clean:
        notes.append("Empty suppression losses (and `run/acc_drop_vs_mean` in results.csv): the comparison needs a "
                     "run of the mean rule with attack=none in the sweep (add `mean` to the rules, `none` to the "
                     "attacks).")
    return [n for note in notes for n in (note, "")]


def _markdown(sweep: SweepData, results: pd.DataFrame, trade: pd.DataFrame, settings: list[str],
              figures: dict[str, list[str]]) -> str:
    avail = availability_table(results)
    kind = "Availability against bias" if avail is not None else "Integrity vs suppression"
    lines = [f"# {kind}: report of `{sweep.root}`", "", _counts(results) + ".", "",
             "Accuracies are final top-1 test accuracies in %, mean ± standard deviation over seeds; "
             "†k: k of the runs diverged (non-finite values) and are scored at chance accuracy 1/C. "
             "Suppression and integrity losses are in percentage points (pp); smaller is better "
             "(definitions at the end).", ""]
    if avail is not None:
        lines += ["## Availability against bias", "",
                  "How far each update moves from the synchronous, full-participation honest mean as fewer "
                  "(participation) or staler (τ) rows reach the server: `bias` = mean over updates of "
                  "‖update − honest mean of all n‖, `rel. bias` = the same over ‖honest mean‖ "
                  "(`agg/bias_vs_sync`, docs/metrics.md). Local-round bias is in model-delta units and "
                  "synchronous bias in gradient units: compare the relative column across protocols. Means "
                  "over seeds; `rounds over f`: rounds whose sampled Byzantine clients exceeded the rule's f.", "",
                  to_markdown(avail, index=False), ""]
    if len(settings) > 1 and (results["attack"] == "none").any():
        lines += ["## No attack: final test accuracy (%) across settings", "",
                  "What each rule throws away as the data gets more heterogeneous (suppression at a glance).", "",
                  to_markdown(across_settings(results, settings)), ""]
    for setting in settings:
        sub = results[results["setting"] == setting]
        meta = sub.iloc[0]
        seeds = sorted(sub["seed"].unique().tolist())
        lines += [f"## {setting}", "",
                  f"{meta['data']}, n = {meta['n']} workers, f = {meta['f']} declared, seeds {seeds}.", "",
                  "### Final test accuracy (%), rule × attack", "", to_markdown(pivot(results, "final_acc", setting)), ""]
        t = trade[trade["setting"] == setting]
        if len(t):
            view = pd.DataFrame({
                "rule": t["rule"],
                "suppression loss (pp)": [_pp(v) for v in t["suppression_loss"]],
                "integrity loss (pp)": [_pp(v) for v in t["integrity_loss"]],
                "worst attack": t["worst_attack"].replace("", "—"),
                "on frontier": ["yes" if v else "" for v in t["frontier"]],
                "seeds": t["seeds"]})
            lines += ["### Integrity vs suppression per rule", "",
                      to_markdown(view.set_index("rule")), ""]
            lines += _empty_column_notes(sub)
        asr = backdoor_table(results, setting)
        if asr is not None:
            lines += ["### Backdoor attack success rate (%), rule × attack", "",
                      "Fraction of the test images not of the target class, stamped with the full trigger, that "
                      "the final model classifies as the target (`test/asr`; higher = the backdoor took).", "",
                      to_markdown(asr), ""]
        lines += ["### Worst-class test accuracy (%), rule × attack", "",
                  to_markdown(pivot(results, "worst_class_acc", setting)), ""]
        for fig in figures.get(setting, []):
            lines += [_figure_link(fig), ""]
    for fig in figures.get("", []):
        lines += [_figure_link(fig), ""]
    skipped = results[results["status"] != "ok"]
    if len(skipped):
        lines += ["## Runs that did not finish", "",
                  "skipped: the configuration breaks a requirement (intended: the sweep goes on); diverged: "
                  "non-finite values during training (scored at chance); invalid: a bad configuration value "
                  "(fix the sweep); failed: any other error; missing: no final evaluation and no reason "
                  "(crashed, killed or still running).", ""]
        grouped = skipped.groupby(["status", "rule", "reason"], sort=False).size().reset_index(name="runs")
        lines += [to_markdown(grouped, index=False), ""]
    lines += ["## Definitions", "",
              "- `run/acc_drop_vs_mean` = accuracy of the run − accuracy of the mean rule with no attack "
              "(same data, partition, model, trainer and seed).",
              "- `run/suppression` = accuracy of the rule with no attack − the mean's with no attack "
              "(same context). The suppression loss is its negative, averaged over seeds.",
              "- `run/integrity` = accuracy of the rule under the attack − the same rule with no attack "
              "(same context). The integrity loss is the largest, over attacks, of its negative averaged "
              "over seeds; the worst attack is the one attaining it.",
              "- A rule is on the frontier when no other rule has both losses at most as large and one "
              "strictly smaller.",
              "- kappa-hat = ‖F(X) − x̄_H‖² / V(H) per step; literature bounds from each rule's "
              "`requirement.kappa_bound(n, f)`; no rule can guarantee less than f/(n−2f).",
              "- Label skew = total-variation distance between a worker's label histogram and the pool's; "
              "relative weight = n × the worker's share of the aggregate (1 = a fair share).", ""]
    return "\n".join(lines)


def _figure_link(name: str) -> str:
    """Markdown for a figure file: an image (PNG, SVG) or, for a PDF that no Markdown viewer shows
    inline, a link."""
    return f"[{name}]({name})" if name.endswith(".pdf") else f"![{name}]({name})"


def build_report(root: str | os.PathLike[str], out_dir: Optional[str | os.PathLike[str]] = None, *,
                 wandb: Optional[bool] = None, wandb_mode: Optional[str] = None,
                 wandb_project: Optional[str] = None, fmt: str = "png") -> Report:
    """Read the sweep under ``root`` and write the report files (see the module docstring).

    Args:
        root: the multirun folder (any folder whose sub-folders hold ``.hydra/config.yaml``).
        out_dir: where to write (default ``<root>/report``).
        wandb: log tables and images to W&B; ``None``: when the runs used ``logger=wandb``.
        wandb_mode: ``offline`` (default), ``online`` or ``disabled``; ``$WANDB_MODE`` wins.
        wandb_project: W&B project (default: the runs' ``logger.project``, else ``robustagg``).
        fmt: the figures' file format, ``png`` (default), ``pdf`` or ``svg``.

    Returns:
        a :class:`Report`.

    Raises:
        ConfigError: ``root`` does not exist or holds no run; ``fmt`` is not a known format.
    """
    if fmt not in FIGURE_FORMATS:
        raise ConfigError(f"report format must be one of {', '.join(FIGURE_FORMATS)}; got {fmt!r}.")
    sweep = load_sweep(root)
    out = Path(out_dir) if out_dir is not None else Path(root) / "report"
    results = add_derived(sweep.runs)
    settings = sorted(dict.fromkeys(results["setting"]), key=lambda s: (not s.startswith("iid"), s))
    trade = tradeoff(results)
    files: list[Path] = []
    files.append(write_csv(out / "results.csv", results[[c for c in RESULT_COLUMNS if c in results.columns]]))
    files.append(write_csv(out / "tradeoff.csv", trade))
    weights = sweep.weights.merge(results[["run_id", "rule", "attack", "setting", "seed"]], on="run_id", how="left")
    files.append(write_csv(out / "weights.csv", weights))
    figures: dict[str, list[str]] = {}
    ok = results[results["status"].isin(("ok", "diverged"))]
    if len(ok):
        files.append(save_figure(accuracy_heatmap(results, settings), out / f"accuracy_heatmap.{fmt}"))
        figures.setdefault("", []).append(f"accuracy_heatmap.{fmt}")
        worst = worst_case(results)
        files.append(write_csv(out / "worst_case.csv", worst))
        if (worst["attacks"] > 0).any():
            files.append(save_figure(worst_case_heatmap(worst, setting_order(worst), RULE_ORDER), out / f"worst_case_heatmap.{fmt}"))
            figures[""].append(f"worst_case_heatmap.{fmt}")
        if trade[["suppression_loss", "integrity_loss"]].notna().all(axis=1).any():
            files.append(save_figure(tradeoff_scatter(trade, settings), out / f"tradeoff.{fmt}"))
            figures[""].append(f"tradeoff.{fmt}")
        for setting in settings:
            fig = kappa_curves(results, sweep.kappa, setting)
            if fig is not None:
                name = f"kappa_{slug(setting)}.{fmt}"
                files.append(save_figure(fig, out / name))
                figures.setdefault(setting, []).append(name)
        for setting in settings:
            for metric in ("acc", "loss"):
                fig = learning_curves(results, sweep.curves, setting, metric)
                if fig is not None:
                    name = f"learning_{metric}_{slug(setting)}.{fmt}"
                    files.append(save_figure(fig, out / name))
                    figures.setdefault(setting, []).append(name)
        for axis in ("participation", "tau"):
            fig = availability_vs_bias(results, axis)
            if fig is not None:
                name = f"availability_{axis}.{fmt}"
                files.append(save_figure(fig, out / name))
                figures.setdefault("", []).append(name)
        fig = weight_vs_skew(results, sweep.weights)
        if fig is not None:
            files.append(save_figure(fig, out / f"weights_vs_skew.{fmt}"))
            figures[""].append(f"weights_vs_skew.{fmt}")
    text = _markdown(sweep, results, trade, settings, figures)
    files.append(write_text(out / "report.md", text))
    report = Report(out_dir=out, results=results, tradeoff=trade, settings=settings, files=files, markdown=text)
    use_wandb = wandb if wandb is not None else bool((results["logger"] == "wandb").any())
    if use_wandb:
        from .report_wandb import log_report

        log_report(report, mode=wandb_mode, project=wandb_project)
    return report


def redraw(report_dir: str | os.PathLike[str], out_dir: Optional[str | os.PathLike[str]] = None, *,
           fmt: str = "png") -> list[Path]:
    """Draw the figures that need only a report's CSV files again, from ``results.csv``,
    ``tradeoff.csv`` and ``weights.csv`` in ``report_dir``: the accuracy heatmap, the trade-off
    plot and the weights against label skew (the kappa-hat and learning curves need the runs'
    ``metrics.jsonl``). This is how the figures in ``docs/img`` are made from result files,
    without the sweep's run folders.

    Args:
        report_dir: a folder written by :func:`build_report` (or one holding its three CSVs).
        out_dir: where to write (default ``report_dir``).
        fmt: ``png`` (default), ``pdf`` or ``svg``.

    Returns:
        the figure files written.

    Raises:
        ConfigError: a CSV is missing, or ``fmt`` is not a known format.
    """
    if fmt not in FIGURE_FORMATS:
        raise ConfigError(f"report format must be one of {', '.join(FIGURE_FORMATS)}; got {fmt!r}.")
    src = Path(report_dir)
    out = Path(out_dir) if out_dir is not None else src
    tables = {}
    for name in ("results", "tradeoff", "weights"):
        path = src / f"{name}.csv"
        if not path.is_file():
            raise ConfigError(f"no {path.name} in {str(src)!r}: pass a folder written by python -m experiments.report.")
        tables[name] = pd.read_csv(path, keep_default_na=False, na_values=[""])
    results, trade, weights = tables["results"], tables["tradeoff"], tables["weights"]
    for col in ("rule", "attack", "setting", "status"):
        results[col] = results[col].astype(str)
    trade["frontier"] = trade["frontier"].astype(str).str.lower().isin(("true", "1"))
    settings = sorted(dict.fromkeys(results["setting"]), key=lambda s: (not s.startswith("iid"), s))
    files = [save_figure(accuracy_heatmap(results, settings), out / f"accuracy_heatmap.{fmt}")]
    if trade[["suppression_loss", "integrity_loss"]].notna().all(axis=1).any():
        files.append(save_figure(tradeoff_scatter(trade, settings), out / f"tradeoff.{fmt}"))
    fig = weight_vs_skew(results, weights.drop(columns=["rule", "attack", "setting", "seed"], errors="ignore"))
    if fig is not None:
        files.append(save_figure(fig, out / f"weights_vs_skew.{fmt}"))
    return files


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``python -m experiments.report <multirun dir> [--out DIR] [--wandb] [--format png|pdf|svg]``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help="the multirun folder Hydra printed (e.g. multirun/<experiment>/<date_time>)")
    parser.add_argument("--out", default=None, help="output folder (default: <sweep>/report)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--wandb", dest="wandb", action="store_true", default=None,
                       help="log the tables and figures to W&B (default: when the runs did)")
    group.add_argument("--no-wandb", dest="wandb", action="store_false", help="never log to W&B")
    parser.add_argument("--wandb-mode", default=None, choices=["offline", "online", "disabled"],
                        help="W&B mode (default offline; $WANDB_MODE wins)")
    parser.add_argument("--wandb-project", default=None, help="W&B project (default: the runs' logger.project)")
    parser.add_argument("--format", default="png", choices=FIGURE_FORMATS, dest="fmt",
                        help="file format of the figures (default png; pdf or svg for a paper)")
    parser.add_argument("--redraw", action="store_true",
                        help="SWEEP is a report folder: draw its heatmap, trade-off and weights figures again "
                             "from its CSV files (no run folders needed)")
    args = parser.parse_args(argv)
    if args.redraw:
        try:
            for path in redraw(args.sweep, args.out, fmt=args.fmt):
                print(f"figure: {path}")
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        report = build_report(args.sweep, args.out, wandb=args.wandb, wandb_mode=args.wandb_mode,
                              wandb_project=args.wandb_project, fmt=args.fmt)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {report.out_dir / 'report.md'} ({_counts(report.results)})")
    for setting in report.settings:
        print(f"\nfinal test accuracy (%) — {setting}")
        print(to_markdown(pivot(report.results, "final_acc", setting)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
