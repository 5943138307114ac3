"""The results page (``docs/results.md``): its tables are generated from committed result files.

Two steps, so that every number on the page comes from a file in the repository:

    python -m experiments.results_page collect fmnist_benchmark <sweep folder>   # sweep -> docs/results/
    python -m experiments.results_page render                                    # docs/results/ -> the page

``collect`` runs the sweep report (:func:`experiments.report.build_report`) and keeps, under
``docs/results/<name>/``, its CSV files (without the machine's run folders) and figures, plus
``cost.json`` (runs and CPU seconds summed from each job's ``job_timing.json``). ``render``
rewrites every block of the page between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``
from those files (also in the README: the tour's table on Fashion-MNIST); ``render --check`` (and ``tests/test_results_page.py``) fails when a block
differs from what the files give.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd

__all__ = ["ROOT", "PAGE", "PAGES", "RESULTS", "collect", "render_block", "render_page", "blocks", "main"]

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
#: Every page with generated blocks (the README quotes the tour on Fashion-MNIST).
PAGES = (PAGE, ROOT / "README.md")
RESULTS = ROOT / "docs" / "results"

#: The report's files kept by :func:`collect` (figures whose name starts so are kept too).
KEPT_CSV = ("results.csv", "tradeoff.csv", "worst_case.csv")
KEPT_FIGURES = ("worst_case_heatmap.png", "accuracy_heatmap.png", "tradeoff.png", "learning_acc_")

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


def collect(name: str, sweep: str | Path, *, results: Path = RESULTS) -> Path:
    """Report the sweep under ``sweep`` and keep its result files in ``results / name``.

    Returns:
        The folder written (its previous content is replaced).

    Raises:
        ConfigError: ``sweep`` holds no run (from :func:`experiments.report.build_report`).
    """
    import tempfile

    from .report import build_report

    dest = results / name
    with tempfile.TemporaryDirectory() as tmp:
        report = build_report(sweep, Path(tmp) / "report", wandb=False)
        staged = Path(tmp) / "kept"
        staged.mkdir()
        for csv in KEPT_CSV:
            df = pd.read_csv(report.out_dir / csv)
            df.drop(columns=[c for c in ("run_dir",) if c in df.columns]).to_csv(staged / csv, index=False)
        for f in sorted(report.out_dir.iterdir()):
            if f.suffix == ".png" and any(f.name == k or f.name.startswith(k) for k in KEPT_FIGURES):
                shutil.copyfile(f, staged / f.name)
        timings = [json.loads(p.read_text()) for p in Path(sweep).rglob("job_timing.json")]
        status = report.results["status"].value_counts().to_dict()
        cost = {"runs": int(len(report.results)), "status": {k: int(v) for k, v in sorted(status.items())},
                "timed_jobs": len(timings), "cpu_seconds": round(sum(float(t["cpu_s"]) for t in timings), 1),
                "wall_seconds": round(sum(float(t["wall_s"]) for t in timings), 1)}
        (staged / "cost.json").write_text(json.dumps(cost, indent=1, sort_keys=True) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, dest)
    return dest


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


#: Block name -> (the folder or file under docs/results it reads, how it is rendered).
RENDERERS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "fmnist_worst_case": ("fmnist_benchmark", _worst_case),
    "fmnist_cost": ("fmnist_benchmark", _cost),
    "tour_fmnist": ("tour_fmnist.json", _tour),
    "byzfl_accuracy": ("byzfl_accuracy.csv", _byzfl),
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
        print(f"kept: {collect(a.name, a.sweep)}")
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
