"""Redundancy vs robust aggregation at equal compute (docs/redundancy.md quotes its table).

Every cell trains the same model on digits with ``n = 9`` workers, the same per-worker batch and
the same number of steps, so every update costs the same ``9 x batch`` per-example gradients:

- ``dsgd`` with CWTM (``trimmed_mean``) or Krum, ``f = 2``: 9 distinct rows per update;
- ``redundant`` (``r = 3``) with the mean (pure redundancy) or CWTM behind the vote: 3 distinct
  rows per update, the rule's ``f`` derived as ``floor(2 / 2) = 1``;

under no attack, ALIE and sign flip, with the two Byzantine workers placed adversarially (ranks 7
and 8, one replica group) or spread (ranks 2 and 5, two groups). Reported per cell: final
accuracy, worst-class accuracy, mean κ̂ (over the rows the rule received: workers under dsgd,
group outputs under redundant), ``run/suppression`` (accuracy with no attack minus dsgd+mean with
no attack) and ``run/integrity`` (accuracy under the attack minus the same cell with no attack),
vote disagreements, effective batch and gradients per update.

Usage::

    python -m experiments.redundancy_compare --steps 150 --seeds 0 1 --out outputs/redundancy
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from .train import train

CONF = Path(__file__).resolve().parents[1] / "conf"

#: (label, overrides) of the defences compared.
DEFENCES = [
    ("dsgd + mean (no defence)", ["aggregator=mean"]),
    ("dsgd + CWTM", ["aggregator=trimmed_mean"]),
    ("dsgd + Krum", ["aggregator=krum"]),
    ("redundant r=3 + mean", ["protocol=redundant", "aggregator=mean"]),
    ("redundant r=3 + CWTM", ["protocol=redundant", "aggregator=trimmed_mean"]),
]
ATTACKS = ["none", "alie", "sign_flip"]
PLACEMENTS = {"adversarial": "[7,8]", "spread": "[2,5]"}


def _run(overrides: list[str], out: Path) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.progress=false", "trainer.mode=simulated",
                                           "strict=false", *overrides])
    return train(cfg, out_dir=out, quiet=True)


def _mean(v: list[float]) -> float:
    v = [x for x in v if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(v) / len(v) if v else math.nan


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid and print (and write) the Markdown table; returns its rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/redundancy_compare"))
    args = ap.parse_args(argv)
    common = ["threat.n=9", "threat.f=2", f"trainer.steps={args.steps}", f"trainer.batch_size={args.batch}",
              "trainer.eval_every=0"]
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for seed in args.seeds:
        for label, over in DEFENCES:
            for attack in ATTACKS:
                places = ["-"] if attack == "none" else (list(PLACEMENTS) if "redundant" in label else ["adversarial"])
                if label.startswith("dsgd + mean") and attack != "none":
                    continue
                for place in places:
                    ranks = PLACEMENTS.get(place, "null")
                    name = f"{label.split()[0]}-{over[-1].split('=')[1]}-{attack}-{place}-s{seed}"
                    s = _run([*common, *over, f"attack={attack}", f"threat.ranks={ranks}", f"seed={seed}"],
                             args.out / name)
                    cells.setdefault((label, attack, place), []).append(s)
    base = _mean([s["final_test_acc"] for s in cells[("dsgd + mean (no defence)", "none", "-")]])
    rows = []
    for (label, attack, place), runs in cells.items():
        acc = _mean([s["final_test_acc"] for s in runs])
        clean = _mean([s["final_test_acc"] for s in cells[(label, "none", "-")]])
        s0 = runs[0]
        rows.append({"defence": label, "attack": attack, "placement": place, "acc": acc,
                     "worst_class_acc": _mean([s["worst_class_acc"] for s in runs]),
                     "kappa_hat": _mean([s["mean_kappa_hat"] for s in runs]),
                     "suppression": clean - base, "integrity": acc - clean if attack != "none" else 0.0,
                     "vote_disagreements": s0.get("vote_disagreements", "-"),
                     "gradients_per_update": s0.get("cost/gradients_per_update", 9),
                     "effective_batch": s0.get("cost/effective_batch", 9 * args.batch)})
    head = ("| defence | attack | Byzantine placement | acc | worst class | mean κ̂ | suppression | integrity | "
            "vote disagreements | gradients / update | effective batch |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['defence']} | {r['attack']} | {r['placement']} | {r['acc']:.3f} | "
                     f"{r['worst_class_acc']:.3f} | {r['kappa_hat']:.3g} | {r['suppression']:+.3f} | "
                     f"{r['integrity']:+.3f} | {r['vote_disagreements']} | {r['gradients_per_update']} | "
                     f"{r['effective_batch']} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "table.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":  # pragma: no cover
    main()
