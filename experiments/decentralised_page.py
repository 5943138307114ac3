"""The decentralised-learning results (``docs/decentralised.md``): collected from sweeps, rendered from files.

Like :mod:`experiments.results_page`, every number on the page comes from a committed file::

    python -m experiments.decentralised_page collect decentralised_digits <sweep folder>   # -> docs/results/
    python -m experiments.results_page render                                              # -> the page

``collect`` reads a ``+experiment=decentralised_vs_topology`` sweep (``protocol=gossip`` runs) into
``docs/results/<name>/``: ``results.csv`` (one row per run: data, topology, node rule, attack, seed,
status and reason, the honest nodes' mean / worst / best test accuracy and the honest average
model's, the final honest consensus distance, the mean over steps of the nodes' mean empirical
robustness coefficient), ``curves.csv`` (per run and step: the consensus distance, and the
worst-node accuracy at the evaluations), ``cost.json`` (CPU seconds from each job's
``job_timing.json``) and one figure per attack, ``curves_<attack>.png`` (consensus distance and
worst-node accuracy over the steps, a panel per topology, a line per node rule). A newer run of
the same cell (data, topology, node rule, attack, seed) replaces the older.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
import yaml

#: the committed result files (the same folder :mod:`experiments.results_page` renders from).
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"

__all__ = ["COLUMNS", "CURVE_COLUMNS", "collect", "accuracy_table", "consensus_table", "cost_line",
           "consensus_experiment_table", "main"]

COLUMNS = ["run_id", "data", "topology", "node_rule", "attack", "seed", "status", "reason", "final_acc",
           "worst_node_acc", "best_node_acc", "average_model_acc", "consensus_distance", "kappa_mean", "cpu_seconds"]
CURVE_COLUMNS = ["run_id", "step", "consensus_distance", "worst_node_acc"]
CELL = ["data", "topology", "node_rule", "attack", "seed"]
#: consensus distance is recorded every step; the curves keep every ``CURVE_EVERY``-th (and the last).
CURVE_EVERY = 5


def _overrides(run: Path) -> dict[str, str]:
    path = run / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(path.read_text()) if path.is_file() else []
    return {k.lstrip("+"): v for k, _, v in (str(o).partition("=") for o in items or [])}


def _run_row(run: Path, rid: str) -> tuple[dict[str, Any], pd.DataFrame]:
    from .report_load import read_metrics

    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    over = _overrides(run)
    proto = cfg.get("protocol") or {}
    row: dict[str, Any] = {"run_id": rid, "data": str((cfg.get("data") or {}).get("name")),
                           "topology": str(proto.get("topology")), "node_rule": str(proto.get("node_rule")),
                           "attack": over.get("attack", "alie"), "seed": int(cfg.get("seed", 0)),
                           "status": "missing", "reason": ""}
    timing = run / "job_timing.json"
    row["cpu_seconds"] = float(json.loads(timing.read_text())["cpu_s"]) if timing.is_file() else math.nan
    skipped = run / "skipped.json"
    summary = run / "summary.json"
    if skipped.is_file():
        s = json.loads(skipped.read_text())
        row.update(status=str(s.get("status", "skipped")), reason=str(s.get("reason", "")))
    elif summary.is_file():
        s = json.loads(summary.read_text())
        row.update(status="ok", final_acc=s.get("final_test_acc"), worst_node_acc=s.get("final_test_acc_worst_node"),
                   average_model_acc=s.get("final_test_acc_average_model"),
                   consensus_distance=s.get("final_consensus_distance"))
    m = read_metrics(run / "metrics.jsonl")
    curve = pd.DataFrame(columns=CURVE_COLUMNS)
    if len(m):
        train = m[m["kind"] == "train"] if "kind" in m else m.iloc[0:0]
        test = m[m["kind"] == "test"] if "kind" in m else m.iloc[0:0]
        if "gossip/kappa_mean" in train:
            k = pd.to_numeric(train["gossip/kappa_mean"], errors="coerce")
            row["kappa_mean"] = float(k[k.notna()].mean()) if k.notna().any() else math.nan
        if len(test) and "test/acc_best_node" in test:
            row["best_node_acc"] = float(test["test/acc_best_node"].iloc[-1])
        if "gossip/consensus_distance" in train:
            last = int(train["step"].max())
            keep = train[(train["step"] % CURVE_EVERY == 0) | (train["step"] == last)]
            curve = pd.DataFrame({"run_id": rid, "step": keep["step"].astype(int),
                                  "consensus_distance": keep["gossip/consensus_distance"].astype(float)})
            if len(test) and "test/acc_worst_node" in test:
                worst = test.set_index("step")["test/acc_worst_node"].astype(float)
                curve["worst_node_acc"] = curve["step"].map(worst)
            else:
                curve["worst_node_acc"] = math.nan
    return row, curve


def _figure(runs: pd.DataFrame, curves: pd.DataFrame, attack: str) -> Optional[Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = runs[(runs["attack"] == attack) & (runs["status"] == "ok")]
    if not len(sel):
        return None
    topologies = list(dict.fromkeys(sel["topology"]))
    rules = list(dict.fromkeys(sel["node_rule"]))
    colors = dict(zip(rules, plt.get_cmap("tab10").colors))  # one distinct colour per node rule
    fig, axes = plt.subplots(2, len(topologies), figsize=(4.2 * len(topologies), 6.4), squeeze=False)
    for j, topo in enumerate(topologies):
        for rule in rules:
            ids = sel[(sel["topology"] == topo) & (sel["node_rule"] == rule)]["run_id"]
            c = curves[curves["run_id"].isin(ids)]
            if not len(c):
                continue
            g = c.groupby("step")
            axes[0, j].plot(g["consensus_distance"].mean().index, g["consensus_distance"].mean().clip(lower=1e-12),
                            color=colors[rule], label=rule)
            acc = g["worst_node_acc"].mean().dropna()
            axes[1, j].plot(acc.index, 100 * acc, marker="o", color=colors[rule], label=rule)
        axes[0, j].set_yscale("log")
        axes[0, j].set_title(f"{topo}, attack={attack}")
        axes[0, j].set_xlabel("step")
        axes[1, j].set_xlabel("step")
    axes[0, 0].set_ylabel("honest consensus distance")
    axes[1, 0].set_ylabel("worst honest node: test accuracy (%)")
    seen: dict[str, Any] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    labels = [r for r in rules if r in seen]
    handles = [seen[r] for r in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def collect(name: str, sweep: str | Path, *, results: Path = RESULTS) -> Path:
    """Merge the ``protocol=gossip`` runs under ``sweep`` into ``results / name`` (see the module docstring).

    Returns:
        The folder written (replaced as a whole, from a staged copy).

    Raises:
        ConfigError: ``sweep`` does not exist or holds no run.
    """
    from robustagg.errors import ConfigError

    from .report import replace_folder, write_csv
    from .report_figures import save_figure
    from .report_load import find_runs

    base = Path(sweep).resolve()
    found = find_runs(base)
    if not found:
        raise ConfigError(f"no run found under {str(base)!r}: expected folders with .hydra/config.yaml.")
    rows, curves = [], []
    for run in found:
        row, curve = _run_row(run, f"{base.name}/{run.relative_to(base)}")
        rows.append(row)
        curves.append(curve)
    new = pd.DataFrame(rows).reindex(columns=COLUMNS)
    new_curves = pd.concat([c for c in curves if len(c)], ignore_index=True) if any(len(c) for c in curves) \
        else pd.DataFrame(columns=CURVE_COLUMNS)
    dest = results / name
    old = pd.read_csv(dest / "results.csv", keep_default_na=False, na_values=[""]) if (dest / "results.csv").is_file() \
        else new.iloc[0:0]
    old_curves = pd.read_csv(dest / "curves.csv") if (dest / "curves.csv").is_file() else new_curves.iloc[0:0]
    replaced = old.merge(new[CELL].drop_duplicates(), on=CELL, how="inner")["run_id"]
    merged = pd.concat([old[~old["run_id"].isin(replaced)], new], ignore_index=True).reindex(columns=COLUMNS)
    merged_curves = pd.concat([old_curves[~old_curves["run_id"].isin(replaced)], new_curves], ignore_index=True)
    cost = {"runs": int(len(merged)), "cpu_seconds": round(float(merged["cpu_seconds"].fillna(0).sum()), 1),
            "status": {k: int(v) for k, v in sorted(merged["status"].value_counts().items())}}
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "kept"
        staged.mkdir()
        write_csv(staged / "results.csv", merged)
        write_csv(staged / "curves.csv", merged_curves.reindex(columns=CURVE_COLUMNS))
        for attack in dict.fromkeys(merged["attack"]):
            fig = _figure(merged, merged_curves, str(attack))
            if fig is not None:
                save_figure(fig, staged / f"curves_{attack}.png")
        (staged / "cost.json").write_text(json.dumps(cost, indent=1, sort_keys=True) + "\n")
        return replace_folder(staged, dest)


def _rule_order(rule: str) -> tuple[int, str]:
    from robustagg.decentralised.rules import NODE_RULES

    return (NODE_RULES.index(rule), "") if rule in NODE_RULES else (len(NODE_RULES), rule)


def _cells(folder: Path) -> tuple[pd.DataFrame, list[str], list[str], list[str]]:
    """The runs, and the node rules (in :data:`~robustagg.decentralised.rules.NODE_RULES` order,
    ``server:<rule>`` after), topologies and attacks (in the order the runs first name them)."""
    t = pd.read_csv(folder / "results.csv", keep_default_na=False, na_values=[""])
    return t, sorted(dict.fromkeys(t["node_rule"]), key=_rule_order), list(dict.fromkeys(t["topology"])), \
        list(dict.fromkeys(t["attack"]))


def _table(folder: Path, cell: Any) -> str:
    t, rules, topologies, attacks = _cells(folder)
    head = "| node rule | " + " | ".join(f"{topo}: {a}" for topo in topologies for a in attacks) + " |"
    lines = [head, "|---|" + "---:|" * (len(topologies) * len(attacks))]
    for rule in rules:
        out = []
        for topo in topologies:
            for a in attacks:
                sel = t[(t["node_rule"] == rule) & (t["topology"] == topo) & (t["attack"] == a)]
                out.append(cell(sel))
        lines.append(f"| {rule} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def _not_ok(sel: pd.DataFrame) -> Optional[str]:
    if not len(sel):
        return "–"
    if not (sel["status"] == "ok").any():
        return str(sel["status"].iloc[0])
    return None


def accuracy_table(folder: Path) -> str:
    """Worst honest node's final test accuracy (%), with the honest nodes' mean in brackets (the
    mean over the seeds that finished; ``skipped``: a node's requirement is broken there)."""
    def cell(sel: pd.DataFrame) -> str:
        bad = _not_ok(sel)
        if bad is not None:
            return bad
        ok = sel[sel["status"] == "ok"]
        return f"{100 * ok['worst_node_acc'].mean():.1f} ({100 * ok['final_acc'].mean():.1f})"

    return _table(folder, cell)


def consensus_table(folder: Path) -> str:
    """The honest nodes' final consensus distance (mean over the seeds that finished)."""
    def cell(sel: pd.DataFrame) -> str:
        bad = _not_ok(sel)
        return bad if bad is not None else f"{sel[sel['status'] == 'ok']['consensus_distance'].mean():.1e}"

    return _table(folder, cell)


def cost_line(folder: Path) -> str:
    """How many runs, by status, and the CPU-hours they took."""
    c = json.loads((folder / "cost.json").read_text())
    status = ", ".join(f"{v} {k}" for k, v in c["status"].items())
    return f"{c['runs']} runs ({status}); {c['cpu_seconds'] / 3600:.2f} CPU-hours.\n"


def consensus_experiment_table(path: Path) -> str:
    """The consensus experiment (``docs/results/gossip_consensus.csv``): final honest consensus
    distance (from the starting one in the header) per node rule, topology and attack; ``refused``
    where a node's requirement is broken, ``diverged`` where it blew up."""
    t = pd.read_csv(path, keep_default_na=False, na_values=[""])
    rules, topologies, attacks = (list(dict.fromkeys(t[c])) for c in ("rule", "topology", "attack"))
    lines = []
    for topo in topologies:
        sub = t[t["topology"] == topo]
        start = sub[sub["attack"] == "none"]["consensus_start"].dropna()
        lines.append(f"**{topo}** (Byzantine nodes {sub[sub['attack'] != 'none']['byzantine'].iloc[0]}, node_f "
                     f"{int(sub['node_f'].iloc[0])}, honest spectral gap {sub[sub['attack'] != 'none']['spectral_gap'].iloc[0]:.3f}; "
                     f"consensus distance at the start {start.iloc[0]:.2f} with everyone honest):\n")
        lines.append("| node rule | " + " | ".join(attacks) + " |")
        lines.append("|---|" + "---:|" * len(attacks))
        for rule in rules:
            out = []
            for a in attacks:
                r = sub[(sub["rule"] == rule) & (sub["attack"] == a)].iloc[0]
                st = str(r["status"])
                out.append(f"{float(r['consensus_end']):.1e}" if st == "ok" else st.split(":")[0])
            lines.append(f"| {rule} | " + " | ".join(out) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``collect NAME SWEEP``."""
    p = argparse.ArgumentParser(prog="python -m experiments.decentralised_page", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("name")
    c.add_argument("sweep")
    a = p.parse_args(argv)
    from robustagg.errors import ConfigError

    try:
        print(f"kept: {collect(a.name, a.sweep)}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
