"""Regenerate ``docs/results/integrity_vs_suppression_quick.csv``: the quick sweep's trained cells.

``python scripts/quick_sweep_results.py`` (about a minute on 2 cores) trains each cell of
``+experiment=integrity_vs_suppression_quick`` that runs (Bulyan's are skipped by its requirement),
composed exactly as the sweep composes it, in this process, and writes one row per cell: the rule's
name, the rule choice, the attack, the partition, the seed and the final test accuracy in percent
(one decimal, as the tables print it). The tables of ``README.md`` and ``docs/experiments.md`` quote
this file; ``tests/test_docs_results.py`` checks every number, and one cell against a fresh run.
"""

from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "integrity_vs_suppression_quick.csv"
RULES = ("mean", "coordinate_median", "krum", "bucketing_coordinate_median")
ATTACKS = ("none", "sign_flip", "alie")
PARTITIONS = ("iid", "dirichlet")
FIELDS = ("rule", "experiment_rule", "attack", "partition", "seed", "final_acc")


def overrides(rule: str, attack: str, partition: str, seed: int = 0) -> list[str]:
    """The overrides of one job of the quick sweep (W&B off: it does not change the numbers)."""
    return ["+experiment=integrity_vs_suppression_quick", f"+experiment/rule={rule}", f"attack={attack}",
            f"data.partition={partition}", f"seed={seed}", "logger=none"]


def cell(rule: str, attack: str, partition: str, out_dir: Path, seed: int = 0) -> dict[str, object]:
    """Train one cell and return its row (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir

    import experiments.config  # noqa: F401  (registers the schema)
    from experiments.train import train

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides(rule, attack, partition, seed))
    s = train(cfg, out_dir=out_dir, quiet=True)
    return {"rule": s["rule"], "experiment_rule": rule, "attack": attack, "partition": partition, "seed": seed,
            "final_acc": f"{100 * s['final_test_acc']:.1f}"}


def main() -> None:
    """Train every cell and write :data:`OUT`."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = [cell(r, a, p, Path(tmp) / f"{r}-{a}-{p}") for r in RULES for p in PARTITIONS for a in ATTACKS]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {OUT} ({len(rows)} cells)")


if __name__ == "__main__":
    main()
