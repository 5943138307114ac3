"""The tables of docs/performance.md's "Round 3" section, rendered from the committed files under
``docs/results/performance/`` (``python scripts/perf_round3.py`` prints them; ``tests/test_perf_round3.py``
checks that the page holds exactly these tables, so every number quoted there comes from a file).

Files: ``bench_train.csv`` and ``startup.csv`` (``python -m experiments.bench_train clock=cpu``),
``bench_byzfl_n10.csv`` / ``bench_byzfl_n100.csv`` (``python -m experiments.bench_byzfl --clock cpu``),
``bench_small_d.csv`` (``python -m experiments.bench 'ns=[10]' 'ds=[4810,100000]' naive=false
memory=false clock=cpu repeats=5``), ``sweep_overhead.csv`` (one and 30 one-step simulated runs in
one ``hydra/launcher=local`` multirun), ``grid_cost_ab.csv`` and ``grid_cost_ab_linesearch.csv`` (``scripts/grid_cost_ab.py``).
"""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "docs" / "results" / "performance"


def _rows(name: str) -> list[dict[str, str]]:
    with (FILES / name).open() as fh:
        return list(csv.DictReader(fh))


def step_table() -> str:
    """The step-time verdicts: every case with a target, its ratio to the plain loop and the verdict."""
    out = ["| case | n | ms | / plain loop (a) | target | verdict |", "|---|---:|---:|---:|---:|---|"]
    for r in _rows("bench_train.csv"):
        if r["target"]:
            out.append(f"| {r['case']} | {r['n']} | {float(r['median_ms']):.2f} | {float(r['ratio_to_floor']):.2f} "
                       f"| {float(r['target']):.2f} | {r['verdict']} |")
    return "\n".join(out)


def startup_table() -> str:
    """The 1-step run: the probe's pieces and the command line, per repeat."""
    out = ["| what | import | data | warm-up | total s | CPU s |", "|---|---:|---:|---:|---:|---:|"]
    for r in _rows("startup.csv"):
        cells = [r["import_s"], r["data_s"], r["warm_up_s"]]
        shown = ["" if not c else f"{float(c):.2f}" for c in cells]
        out.append(f"| {r['what']} | {' | '.join(shown)} | {float(r['total_s']):.2f} | {float(r['cpu_s']):.2f} |")
    return "\n".join(out)


def byzfl_table() -> str:
    """ByzFL's DSGD step against ours, n = 10 and 100: ms per step and ByzFL's time over ours."""
    out = ["| n | ByzFL ms | ours, metrics on, loop: ms | ByzFL / ours | ours, metrics on, default: ms | ByzFL / ours |",
           "|---:|---:|---:|---:|---:|---:|"]
    for name in ("bench_byzfl_n10.csv", "bench_byzfl_n100.csv"):
        rows = {r["case"]: float(r["median_ms"]) for r in _rows(name)}
        n = _rows(name)[0]["n"]
        bz, loop, default = rows["byzfl"], rows["ours, metrics on"], rows["ours, metrics on, default"]
        out.append(f"| {n} | {bz:.2f} | {loop:.2f} | {bz / loop:.2f} | {default:.2f} | {bz / default:.2f} |")
    return "\n".join(out)


def small_d_table() -> str:
    """Every rule's class call at n = 10, d in {4,810, 10^5} against 3 x the mean + 30 us."""
    rows = _rows("bench_small_d.csv")
    by = {(r["rule"], int(r["d"])): r for r in rows}
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    out = ["| rule | d = 4,810: us | target us | d = 10^5: us | target us |", "|---|---:|---:|---:|---:|"]
    for rule in rules:
        cells = []
        for d in (4810, 100000):
            r = by.get((rule, d))
            if r is None or not r["median_ms"] or math.isnan(float(r["median_ms"])):
                cells += ["skipped (n < 4f + 3)", ""]
                continue
            cells += [f"{1e3 * float(r['median_ms']):.0f}", f"{1e3 * (3 * float(r['mean_ms']) + 0.030):.0f}"]
        out.append(f"| {rule} | {' | '.join(cells)} |")
    return "\n".join(out)


def sweep_line() -> str:
    """The per-run overhead of a multirun of one-step runs, from ``sweep_overhead.csv``."""
    r = {int(x["runs"]): x for x in _rows("sweep_overhead.csv")}
    one, many = float(r[1]["sweep_wall_s"]), float(r[30]["sweep_wall_s"])
    per = (many - one) / 29
    inside = float(r[30]["warm_job_wall_s"])
    return (f"1 run: {one:.2f} s, 30 runs: {many:.2f} s, so {per:.2f} s per added run, of which {inside:.2f} s "
            f"inside the job (its CPU: {float(r[30]['warm_job_cpu_s']):.2f} s)")


def _ab(name: str) -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("grid_cost_ab", ROOT / "scripts" / "grid_cost_ab.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.summary(_rows(name)))


def grid_line(name: str = "grid_cost_ab.csv") -> str:
    """A benchmark slice's mean CPU seconds per warm run before and after, from an A/B file."""
    s = _ab(name)
    return (f"before {s['before']:.2f} CPU s per run, after {s['after']:.2f} ({s['ratio']:.2f} times), "
            f"{int(s['runs'])} warm runs a side")


def linesearch_line() -> str:
    """The same for the line-search attacks' slice (``grid_cost_ab_linesearch.csv``)."""
    return grid_line("grid_cost_ab_linesearch.csv")


LINE_SEARCH = ("agr_tailored", "opt_alie", "opt_ipm")


def projection_line() -> str:
    """Seed 0's CPU-hours before (``grid_before.json``: taken from ``cost.json`` and ``results.csv`` as they
    were before this round), and the grid's projected after the two A/B ratios: the line-search runs
    (seed 0's ``opt_*`` shards' CPU per run, times the line-search runs of seed 0) scaled by the
    line-search slice's ratio, the rest by the other slice's."""
    import json

    before = json.loads((FILES / "grid_before.json").read_text())
    total, runs = float(before["seed0_cpu_seconds"]), int(before["seed0_jobs"])
    per_ls, ls_runs = float(before["line_search_cpu_per_run"]), int(before["line_search_runs"])
    ls = per_ls * ls_runs
    after = (total - ls) * _ab("grid_cost_ab.csv")["ratio"] + ls * _ab("grid_cost_ab_linesearch.csv")["ratio"]
    grid_before, grid_after = 3 * total / 3600, 3 * after / 3600
    return (f"seed 0: {runs} jobs in its shards (a re-run cell counted twice), {total / 3600:.2f} CPU-hours before, of which {ls / 3600:.2f} in its {ls_runs} "
            f"line-search runs; projected after: {after / 3600:.2f} CPU-hours a seed, {grid_after:.1f} for the "
            f"grid's three seeds instead of {grid_before:.1f}; on 16 cores {60 * grid_after / 16:.0f} minutes of wall "
            f"time, on 2 cores {grid_after / 2:.1f} hours")


def main() -> None:
    for part in (step_table(), startup_table(), byzfl_table(), small_d_table(), sweep_line(), grid_line(),
                 linesearch_line(), projection_line()):
        print(part, end="\n\n")


if __name__ == "__main__":
    main()
