"""The Fashion-MNIST benchmark's CPU cost per run, before and after a change, from A/B sweeps of one slice.

Run the same slice of ``+experiment=fmnist_benchmark`` with the code before and after, alternating
(``before, after, before, after``), each sweep in its own warm joblib worker (``n_jobs=1``), e.g.::

    for pass in 1 2; do for v in before after; do
      (cd <tree of $v> && PYTHONPATH=$PWD python -m experiments.train -m +experiment=fmnist_benchmark seed=11 \\
         '+experiment/rule=mean,coordinate_median,trimmed_mean,krum,geometric_median,centered_clipping' \\
         'attack=none,sign_flip,alie' +experiment/heterogeneity=iid \\
         hydra.sweep.dir=ab/${v}_$pass hydra.launcher.n_jobs=1)
    done; done
    python scripts/grid_cost_ab.py ab docs/results/grid_cost_ab.csv

Every run folder's ``job_timing.json`` (CPU and wall seconds of the job, written by
``experiments.jobtiming.JobTiming``) and ``.hydra/overrides.yaml`` become one row: ``version`` and
``pass`` (from the sweep folder's name ``<version>_<pass>``), ``rule``, ``attack``, ``cpu_s``,
``wall_s``, ``job_in_process``. The summary (printed, and by :func:`summary` for the docs' test) is
the mean CPU seconds per run over the jobs that were not their worker's first (the first pays the
imports and the compiled kernels' load), per version, and after / before.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from statistics import mean

import yaml

FIELDS = ["version", "pass", "rule", "attack", "cpu_s", "wall_s", "job_in_process"]


def collect(root: Path) -> list[dict[str, object]]:
    """One row per finished run folder under ``root/<version>_<pass>/<job>/``."""
    rows: list[dict[str, object]] = []
    for sweep in sorted(p for p in root.iterdir() if p.is_dir() and "_" in p.name):
        version, _, number = sweep.name.rpartition("_")
        for run in sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
            timing, overrides = run / "job_timing.json", run / ".hydra" / "overrides.yaml"
            if not timing.is_file() or not overrides.is_file():
                continue
            t = json.loads(timing.read_text())
            o = dict(x.split("=", 1) for x in yaml.safe_load(overrides.read_text()) if "=" in x)
            rows.append({"version": version, "pass": int(number), "rule": o.get("+experiment/rule", ""),
                         "attack": o.get("attack", ""), "cpu_s": round(float(t["cpu_s"]), 3),
                         "wall_s": round(float(t["wall_s"]), 3), "job_in_process": int(t["job_in_process"])})
    return rows


def summary(rows: list[dict[str, str]] | list[dict[str, object]]) -> dict[str, float]:
    """``{"before": s, "after": s, "ratio": after / before, "runs": n}``: mean CPU seconds per warm run."""
    per = {v: [float(str(r["cpu_s"])) for r in rows if r["version"] == v and int(str(r["job_in_process"])) > 1]
           for v in ("before", "after")}
    before, after = mean(per["before"]), mean(per["after"])
    return {"before": before, "after": after, "ratio": after / before,
            "runs": float(min(len(per["before"]), len(per["after"])))}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/grid_cost_ab.py <folder of <version>_<pass> sweeps> <out.csv>", file=sys.stderr)
        return 2
    rows = collect(Path(argv[0]))
    with open(argv[1], "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    s = summary(rows)
    print(f"{len(rows)} runs; CPU s per warm run: before {s['before']:.2f}, after {s['after']:.2f}, "
          f"after / before {s['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
