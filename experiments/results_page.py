"""The results page (``docs/results.md``): its tables are generated from committed result files.

Two steps, so that every number on the page comes from a file in the repository:

    python -m experiments.results_page collect fmnist_benchmark <sweep folder>   # sweep -> docs/results/
    python -m experiments.results_page render                                    # docs/results/ -> the page

``collect`` merges a sweep's runs (a whole benchmark or one shard of it) into the per-run tables under
``docs/results/<name>/`` (``results.csv``, ``curves.csv``; a newer run of the same cell replaces the
older) and draws the report's tables and figures again from the merged rows, plus ``cost.json``
(runs, and CPU seconds summed from each job's ``job_timing.json``, per shard and in total). ``render``
rewrites every block of the page between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``
from those files (also in the README: the tour's table on Fashion-MNIST); ``render --check`` (and ``tests/test_results_page.py``) fails when a block
differs from what the files give.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd

__all__ = ["ROOT", "PAGE", "PAGES", "RESULTS", "collect", "render_block", "render_page", "blocks", "main"]

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
#: Every page with generated blocks (the README quotes the tour on Fashion-MNIST).
PAGES = (PAGE, ROOT / "README.md", ROOT / "docs" / "decentralised.md")
RESULTS = ROOT / "docs" / "results"

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


#: The columns that name one run of a benchmark: a newer run of the same cell replaces the older one.
CELL = ["rule", "attack", "setting", "seed"]


def _read_table(path: Path) -> pd.DataFrame:
    """A committed CSV as the report wrote it (empty cells are missing values, names stay text)."""
    df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    for col in ("run_id", "rule", "attack", "setting", "status"):
        if col in df.columns:
            df[col] = df[col].astype(str)
    return df


def collect(name: str, sweep: str | Path, *, results: Path = RESULTS) -> Path:
    """Merge the runs under ``sweep`` into the committed result files in ``results / name``.

    Every run of the sweep becomes one row of ``results.csv`` (its ``run_id`` prefixed with the
    sweep folder's name, so shards run on different days never collide) and its evaluations rows
    of ``curves.csv``; a row already there for the same cell (:data:`CELL`: rule, attack, setting,
    seed) is replaced, every other row is kept. The tables and figures (trade-off, worst case,
    heatmaps, learning curves) are then drawn again from the merged rows, so a benchmark too big
    for one session is collected shard by shard and the run folders need not survive. ``cost.json``
    adds the shard's CPU and wall seconds (from each job's ``job_timing.json``) to the totals and
    lists every shard collected.

    A benchmark's setting is its heterogeneity (``iid``, ``dirichlet(a=0.5)``, ...): every other
    choice is fixed by its experiment config, and what a rule brings with it (FLTrust's clean root
    set, ``server.root_samples``) belongs to the rule, so FLTrust is compared with the other rules
    in the same panel instead of a panel of its own.

    Returns:
        The folder written (replaced as a whole, from a staged copy).

    Raises:
        ConfigError: ``sweep`` holds no run (from :func:`experiments.report_load.load_sweep`).
    """
    import tempfile

    from .report import RESULT_COLUMNS, replace_folder, write_csv
    from .report_figures import accuracy_heatmap, learning_curves, save_figure, tradeoff_scatter
    from .report_load import CURVE_COLUMNS, load_sweep
    from .report_tables import RULE_ORDER, add_derived, slug, tradeoff
    from .report_worstcase import setting_order, worst_case, worst_case_heatmap

    dest = results / name
    batch = Path(sweep).resolve().name
    data = load_sweep(sweep)
    new = add_derived(data.runs)
    new = new[[c for c in RESULT_COLUMNS if c in new.columns and c != "run_dir"]].copy()
    new["run_id"] = batch + "/" + new["run_id"].astype(str)
    curves = data.curves.copy()
    curves["run_id"] = batch + "/" + curves["run_id"].astype(str)
    new["setting"] = new["heterogeneity"].astype(str)
    old = _read_table(dest / "results.csv") if (dest / "results.csv").is_file() else new.iloc[0:0]
    old["setting"] = old["heterogeneity"].astype(str)
    old_curves = _read_table(dest / "curves.csv") if (dest / "curves.csv").is_file() else curves.iloc[0:0]
    replaced = old.merge(new[CELL].drop_duplicates(), on=CELL, how="inner")["run_id"]
    old = old[~old["run_id"].isin(replaced)]
    merged = pd.concat([old, new], ignore_index=True)
    merged["setting"] = merged["heterogeneity"].astype(str)  # see the docstring: a rule's own server data is not a setting
    merged_curves = pd.concat([old_curves[~old_curves["run_id"].isin(replaced)], curves], ignore_index=True)
    merged_curves = merged_curves[[c for c in CURVE_COLUMNS if c in merged_curves.columns]]
    timings = [json.loads(p.read_text()) for p in Path(sweep).rglob("job_timing.json")]
    shard = {"sweep": batch, "runs": int(len(new)), "timed_jobs": len(timings),
             "cpu_seconds": round(sum(float(t["cpu_s"]) for t in timings), 1),
             "wall_seconds": round(sum(float(t["wall_s"]) for t in timings), 1)}
    before = json.loads((dest / "cost.json").read_text()) if (dest / "cost.json").is_file() else {}
    shards = before.get("shards", [{k: before[k] for k in ("runs", "timed_jobs", "cpu_seconds", "wall_seconds")}
                                   | {"sweep": "(collected before shards were listed)"}] if before else [])
    shards = [s for s in shards if s["sweep"] != batch] + [shard]
    status = merged["status"].value_counts().to_dict()
    cost = {"runs": int(len(merged)), "status": {k: int(v) for k, v in sorted(status.items())},
            "timed_jobs": sum(s["timed_jobs"] for s in shards),
            "cpu_seconds": round(sum(s["cpu_seconds"] for s in shards), 1),
            "wall_seconds": round(sum(s["wall_seconds"] for s in shards), 1), "shards": shards}
    settings = sorted(dict.fromkeys(merged["setting"]), key=lambda v: (not v.startswith("iid"), v))
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "kept"
        staged.mkdir()
        write_csv(staged / "results.csv", merged)
        write_csv(staged / "curves.csv", merged_curves)
        trade = tradeoff(merged)
        write_csv(staged / "tradeoff.csv", trade)
        worst = worst_case(merged)
        write_csv(staged / "worst_case.csv", worst)
        save_figure(accuracy_heatmap(merged, settings), staged / "accuracy_heatmap.png")
        if (worst["attacks"] > 0).any():
            save_figure(worst_case_heatmap(worst, setting_order(worst), RULE_ORDER), staged / "worst_case_heatmap.png")
        if trade[["suppression_loss", "integrity_loss"]].notna().all(axis=1).any():
            save_figure(tradeoff_scatter(trade, settings), staged / "tradeoff.png")
        for setting in settings:
            fig = learning_curves(merged, merged_curves, setting, "acc")
            if fig is not None:
                save_figure(fig, staged / f"learning_acc_{slug(setting)}.png")
        (staged / "cost.json").write_text(json.dumps(cost, indent=1, sort_keys=True) + "\n")
        return replace_folder(staged, dest)


def _pm(mean: float, std: float) -> str:
    return "—" if not math.isfinite(mean) else f"{mean:.1f} ± {std:.1f}"


def _worst_case(folder: Path) -> str:
    """Rules x settings: accuracy with no attack and the worst case over attacks (worst attack)."""
    t = pd.read_csv(folder / "worst_case.csv").fillna({"worst_attack": ""})
    from .report_tables import RULE_ORDER

    from .report_worstcase import setting_order

    settings = setting_order(t)
    rules = [r for r in RULE_ORDER if r in set(t["rule"])] + sorted(set(t["rule"]) - set(RULE_ORDER))
    head = ["rule"] + [f"{s}: no attack" for s in settings] + [f"{s}: worst case (attack)" for s in settings]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (2 * len(settings))]
    for rule in rules:
        cells = [rule]
        rows = {r["setting"]: r for _, r in t[t["rule"] == rule].iterrows()}
        for s in settings:
            r = rows.get(s)
            cells.append(_pm(r["no_attack_acc"], r["no_attack_std"]) if r is not None else "—")
        for s in settings:
            r = rows.get(s)
            ok = r is not None and int(r["attacks"]) > 0
            cells.append(f"{_pm(r['worst_acc'], r['worst_std'])} ({r['worst_attack']}, {int(r['attacks'])} attacks)"
                         if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _accuracy_table(folder: Path, *, by_setting: bool) -> str:
    """Rules (x settings) by attacks: final test accuracy (%), mean ± standard deviation over the
    seeds that ran (their count after it), from ``results.csv``; its runs that were skipped or
    diverged are not averaged, and a cell without a finished run is ``—``."""
    from .report_tables import RULE_ORDER

    t = pd.read_csv(folder / "results.csv")
    t = t[t["status"] == "ok"]
    attacks = ["none"] * ("none" in set(t["attack"])) + sorted(set(t["attack"]) - {"none"})
    rules = [r for r in RULE_ORDER if r in set(t["rule"])] + sorted(set(t["rule"]) - set(RULE_ORDER))
    settings = (sorted(set(t["setting"]), key=lambda v: (not str(v).startswith("iid"), str(v))) if by_setting
                else [None])
    head = "| rule | setting | " if by_setting else "| rule | "
    lines = [head + " | ".join(attacks) + " |", "|---|" + "---|" * by_setting + "---:|" * len(attacks)]
    for rule in rules:
        for setting in settings:
            cells = [rule] + ([str(setting)] if by_setting else [])
            for attack in attacks:
                here = (t["rule"] == rule) & (t["attack"] == attack)
                acc = t[here & (t["setting"] == setting) if by_setting else here]["final_acc"]
                cells.append(f"{_pm(100 * acc.mean(), 100 * acc.std() if len(acc) > 1 else 0.0)} ({len(acc)})"
                             if len(acc) else "—")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rule_by_attack(folder: Path) -> str:
    """Rules x attacks (:func:`_accuracy_table`, every setting together): a reproduction's table."""
    return _accuracy_table(folder, by_setting=False)


def _rule_setting_by_attack(folder: Path) -> str:
    """Rules x settings (heterogeneity) by attacks (:func:`_accuracy_table`): a reproduction over several settings."""
    return _accuracy_table(folder, by_setting=True)


def _backdoor_success(folder: Path) -> str:
    """Rules x backdoor attacks: final attack success rate (%, the triggered test images classified as
    the target label), mean ± standard deviation over the seeds, from ``results.csv``'s ``final_asr``."""
    from .report_tables import RULE_ORDER

    t = pd.read_csv(folder / "results.csv")
    t = t[(t["status"] == "ok") & t["final_asr"].notna()]
    attacks = sorted(set(t["attack"]))
    rules = [r for r in RULE_ORDER if r in set(t["rule"])] + sorted(set(t["rule"]) - set(RULE_ORDER))
    lines = ["| rule | " + " | ".join(f"{a}: ASR" for a in attacks) + " |", "|---|" + "---:|" * len(attacks)]
    for rule in rules:
        cells = [rule]
        for attack in attacks:
            asr = t[(t["rule"] == rule) & (t["attack"] == attack)]["final_asr"]
            cells.append(f"{_pm(100 * asr.mean(), 100 * asr.std() if len(asr) > 1 else 0.0)} ({len(asr)})"
                         if len(asr) else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cost(folder: Path) -> str:
    c = json.loads((folder / "cost.json").read_text())
    status = ", ".join(f"{v} {k}" for k, v in c["status"].items())
    return (f"{c['runs']} runs ({status}); {c['timed_jobs']} timed jobs took {c['cpu_seconds'] / 3600:.2f} CPU-hours "
            f"({c['wall_seconds'] / 3600:.2f} hours of job wall time, summed over the jobs).\n")


def _tour(path: Path) -> str:
    """The table ``experiments.tour`` printed, from its committed ``tour.json``."""
    from .tour import markdown

    return markdown(json.loads(path.read_text()))


def _byzfl(path: Path) -> str:
    """Final accuracy per rule, ours next to ByzFL's, from the committed per-seed CSV."""
    from .byzfl_accuracy import table

    rows = pd.read_csv(path).to_dict("records")
    return table(rows) + "\n"


def _decentralised(kind: str) -> Callable[[Path], str]:
    """A renderer of :mod:`experiments.decentralised_page` (imported when called: it imports this module)."""
    def render(path: Path) -> str:
        from . import decentralised_page

        return getattr(decentralised_page, kind)(path)

    return render


#: Block name -> (the folder or file under docs/results it reads, how it is rendered).
RENDERERS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "fmnist_worst_case": ("fmnist_benchmark", _worst_case),
    "fmnist_cost": ("fmnist_benchmark", _cost),
    "tour_fmnist": ("tour_fmnist.json", _tour),
    "byzfl_accuracy": ("byzfl_accuracy.csv", _byzfl),
    "repro_fang2020": ("repro_fang2020_fmnist", _rule_by_attack),
    "repro_fang2020_full": ("repro_fang2020_fmnist_full", _rule_by_attack),
    "repro_shejwalkar2021": ("repro_shejwalkar2021_fmnist", _rule_by_attack),
    "repro_fltrust2021": ("repro_fltrust2021_fmnist", _rule_by_attack),
    "repro_fltrust2021_asr": ("repro_fltrust2021_fmnist", _backdoor_success),
    "repro_fltrust2021_full": ("repro_fltrust2021_fmnist_full", _rule_by_attack),
    "repro_allouah2023": ("repro_allouah2023_fmnist", _rule_setting_by_attack),
    "gossip_consensus": ("gossip_consensus.csv", _decentralised("consensus_experiment_table")),
    **{f"decentralised_{data}_{what}": (f"decentralised_{data}", _decentralised(fn))
       for data in ("digits", "fmnist")
       for what, fn in (("accuracy", "accuracy_table"), ("consensus", "consensus_table"), ("cost", "cost_line"))},
}


def render_block(name: str, *, results: Path = RESULTS) -> str:
    """The body of block ``name`` as the committed files give it.

    Raises:
        KeyError: no such block. FileNotFoundError: its result file is not committed.
    """
    source, fn = RENDERERS[name]
    return fn(results / source)


def blocks(text: str) -> dict[str, str]:
    """Block name -> body, for every generated block of a page's ``text``."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def render_page(text: str, *, results: Path = RESULTS) -> str:
    """``text`` with every generated block's body replaced by :func:`render_block`'s."""
    return _BLOCK.sub(lambda m: m.group(1) + render_block(m["name"], results=results) + m.group(4), text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``collect NAME SWEEP`` or ``render [--check]`` (exit 1: the page is stale)."""
    p = argparse.ArgumentParser(prog="python -m experiments.results_page", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("name")
    c.add_argument("sweep")
    r = sub.add_parser("render")
    r.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "collect":
        from robustagg.errors import ConfigError

        try:
            print(f"kept: {collect(a.name, a.sweep)}")
        except ConfigError as exc:  # a wrong folder is the user's input: its message, not a traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    stale = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        new = render_page(text)
        if a.check:
            if new != text:
                print(f"{page} is stale: run python -m experiments.results_page render", file=sys.stderr)
                stale = 1
            continue
        page.write_text(new, encoding="utf-8")
        print(f"rendered {len(blocks(new))} blocks into {page}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
