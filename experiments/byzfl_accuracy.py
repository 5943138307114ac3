"""Accuracy side by side with ByzFL: the same training run under each rule, final test accuracy on both sides.

``python -m experiments.byzfl_accuracy --out byzfl_accuracy.csv`` (optional: the ByzFL side needs the
``byzfl`` package on ``PYTHONPATH``, no dependency of this project; without it the script exits with
status 2 and says how to get it, unless ``--sides ours``)::

    pip download byzfl --no-deps -d /tmp/byzfl-dl
    pip install --no-deps --target /tmp/byzfl-pkgs /tmp/byzfl-dl/byzfl-*.whl
    PYTHONPATH=/tmp/byzfl-pkgs:$PWD python -m experiments.byzfl_accuracy --out byzfl_accuracy.csv

For every rule and seed, one of our simulated trainers is built (:func:`experiments.bench_train.build_with_data`:
``data=fashion_mnist``, the MLP of ``conf/model/mlp.yaml``, n = 10, f = 2 Byzantine running ALIE,
batch 32, server SGD lr 0.1 momentum 0.9, no worker momentum, ``seed=<seed>``), and before its first
step :class:`experiments.bench_byzfl.ByzflDSGD` is built from it: ByzFL's ``Client`` / ``Server`` /
``ByzantineClient`` on a deep copy of the same initial model, the same honest shards and the same
batches (a copy of each honest worker's sampler), ALIE as ``ALittleIsEnough(tau=-z)``. Both sides run
``--steps`` steps (interleaved); each final model, as our model object, is evaluated by
:func:`robustagg.training.evaluate` on the whole test set (Fashion-MNIST: the 10,000 test images).

What the seed cannot share: ByzFL's CAF draws the start of its power iteration from torch's global
generator (seeded with the seed before the ByzFL side's run); every other random choice (initial
weights, partition, batch order, ALIE, which is deterministic) is the same object on both sides.

Rules and their ByzFL classes (:data:`RULES`; the differences in convention are :data:`CONVENTIONS`).
Verdict per rule (:func:`verdict`): the two sides agree when the difference of their mean accuracies
over the seeds is at most two standard errors of that difference,
``|mean_ours - mean_byzfl| <= 2 sqrt(s_ours^2 / k + s_byzfl^2 / k)`` (``s`` the seeds' standard
deviation, ddof 1; ``k`` seeds per side), the usual two-sample band; with 3 seeds it is stricter
than a t quantile would be, so it flags a systematic gap rather than hiding it. The printed table
also gives ``max|dtheta| @1``: the largest parameter difference between the sides after the first
step (mean over seeds), 0 up to float rounding where both sides computed the same aggregate.
Writes the CSV ``rule, seed, side, final_test_acc`` (``--out``) and, with ``--table``, the command
line and the printed table as Markdown.

``--diagnose`` (both sides, the first seed) prints instead where the sides part: the largest
parameter difference after steps 1, 10, 25, 50, 100 and the last, and :func:`same_rows` (each
rule's two implementations fed the same rows along ByzFL's run of that rule); ``--table`` gets it.
Results and their reading: ``docs/results/byzfl_accuracy.md``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from .bench_byzfl import MISSING, ByzflDSGD, ByzflMissing, import_byzfl

__all__ = ["RULES", "CONVENTIONS", "COLUMNS", "byzfl_rule", "run", "same_rows", "verdict", "table", "main"]

COLUMNS = ["rule", "seed", "side", "final_test_acc"]

#: rule -> (our aggregator, our preaggregation, ByzFL aggregator name, ByzFL pre-aggregator names).
RULES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "trimmed_mean": ("trimmed_mean", "none", "TrMean", ()),
    "coordinate_median": ("coordinate_median", "none", "Median", ()),
    "krum": ("krum", "none", "Krum", ()),
    "geometric_median": ("geometric_median", "none", "GeometricMedian", ()),
    "nnm_trimmed_mean": ("trimmed_mean", "nnm", "TrMean", ("NNM",)),
    "caf": ("caf", "none", "CAF", ()),
}

#: rule -> how ours and ByzFL 0.0.11 differ (read from both sources), printed under the table.
CONVENTIONS: dict[str, str] = {
    "alie": "both send mu - z sigma (ddof 1) in every Byzantine row, z = Phi^-1((n - s)/n), s = floor(n/2 + 1) - f "
            "(ByzFL's tau = -z); ours computes the statistics in float64, ByzFL in float32.",
    "trimmed_mean": "same: per coordinate, drop the f largest and f smallest, mean of the n - 2f left.",
    "coordinate_median": "same: for even n the average of the two middle values (ByzFL: torch.quantile(q=0.5)).",
    "krum": "ours scores with the n - f - 2 nearest others (Blanchard et al. 2017), ByzFL with n - f - 1 "
            "(sorted distances [1:n-f], their mean: the argmin of a sum); 6 vs 7 neighbours at n = 10, f = 2. "
            "ByzFL's Krum has no parameter for it.",
    "geometric_median": "smoothed Weiszfeld on both sides; ByzFL's defaults are nu = 0.1, T = 3 iterations, start "
                        "at 0; ours nu = 1e-6, max_iter = 100, tol = 0 (stops early only when no distance changes), "
                        "start at the mean. Run with ByzFL's nu and T set to ours; the start point and the early "
                        "stop cannot be set in ByzFL.",
    "nnm_trimmed_mean": "same NNM: each row replaced by the mean of its n - f nearest rows, itself included "
                        "(ties may be broken differently), then the trimmed mean with f.",
    "caf": "ours: exact top eigenpair of the weighted covariance (eigh of the n x n Gram, float64), tau_max over "
           "rows of positive weight, stops also at lambda = 0 or after n iterates; ByzFL: ONE power-iteration "
           "step from a random vector (torch.randn) as the eigenvector, tau_max over all rows. Not settable.",
}


def byzfl_rule(rule: str, f: int, cfg: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """ByzFL's ``aggregator_info`` and ``pre_agg_list`` for ``rule`` (GeometricMedian's nu and T from ``cfg``)."""
    _, _, name, pre = RULES[rule]
    params: dict[str, Any] = {} if name == "Median" else {"f": int(f)}
    if name == "GeometricMedian":
        params = {"nu": float(cfg.aggregator.nu), "T": int(cfg.aggregator.max_iter)}
    return {"name": name, "parameters": params}, [{"name": p, "parameters": {"f": int(f)}} for p in pre]


def _flat(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run(*, rules: Sequence[str] = tuple(RULES), seeds: Sequence[int] = (0, 1, 2), steps: int = 200, n: int = 10,
        f: int = 2, data: str = "fashion_mnist", batch_size: int = 32, lr: float = 0.1, momentum: float = 0.9,
        sides: Sequence[str] = ("ours", "byzfl"), extra: Sequence[str] = (), bz: Optional[Any] = None,
        log: Any = None, trace: Sequence[int] = (1,)) -> tuple[list[dict[str, Any]], dict[str, dict[int, list[float]]]]:
    """Train every (rule, seed) on each side; the CSV rows and ``gaps[rule][t]``: per seed, the largest
    parameter difference between the sides after step ``t`` for every ``t`` in ``trace`` (both sides run).

    Raises:
        ByzflMissing: ``"byzfl"`` in ``sides`` and ByzFL is not importable.
        KeyError: an unknown rule.
    """
    import torch

    from attacks.alie import alie_z
    from robustagg.training import evaluate

    from .bench_train import build_with_data, compose, overrides

    for r in rules:
        RULES[r]
    if "byzfl" in sides and bz is None:
        bz = import_byzfl()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    gaps: dict[str, dict[int, list[float]]] = {r: {} for r in rules}
    for rule in rules:
        ours_rule, ours_pre, _, _ = RULES[rule]
        for seed in seeds:
            ovr = overrides(n, f, ours_rule, "alie", False, extra=(
                f"preaggregation={ours_pre}", f"data={data}", f"seed={seed}", f"trainer.batch_size={batch_size}",
                f"optimizer.lr={lr}", f"optimizer.momentum={momentum}", "trainer.worker_momentum=0.0",
                f"trainer.steps={steps}", *extra))
            cfg = compose(ovr)
            with tempfile.TemporaryDirectory() as tmp:
                trainer, bundle = build_with_data(cfg, tmp)
            runs: dict[str, Any] = {}
            if "byzfl" in sides:
                honest = [r for r in sorted(trainer.shards) if r not in set(trainer.byzantine.ranks)]
                agg, pre = byzfl_rule(rule, f, cfg)
                opt = trainer.optimizer.param_groups[0]
                runs["byzfl"] = ByzflDSGD(bz, trainer, honest, f=f, lr=float(opt["lr"]),
                                          momentum=float(opt["momentum"]), tau=-alie_z(n, f), aggregator=agg,
                                          pre_agg=pre)
                torch.manual_seed(int(seed))  # ByzFL's CAF draws from the global generator
            for t in range(steps):
                if "ours" in sides:
                    trainer.step()
                if "byzfl" in runs:
                    runs["byzfl"].step()
                if t + 1 in trace and len(sides) == 2:
                    gap = float((_flat(trainer.model) - _flat(runs["byzfl"].model())).abs().max())
                    gaps[rule].setdefault(t + 1, []).append(gap)
            models = {"ours": trainer.model, "byzfl": runs["byzfl"].model() if "byzfl" in runs else None}
            for side in sides:
                acc = evaluate(models[side], bundle.test_x, bundle.test_y, int(bundle.num_classes))["test/acc"]
                rows.append({"rule": rule, "seed": int(seed), "side": side, "final_test_acc": float(acc)})
                if log is not None:
                    print(f"{rule:<18} seed {seed} {side:<6} test acc {acc:.4f}", file=log, flush=True)
    return rows, gaps


def same_rows(*, rules: Sequence[str] = tuple(RULES), seed: int = 0, steps: int = 200, n: int = 10, f: int = 2,
              data: str = "fashion_mnist", extra: Sequence[str] = (), bz: Optional[Any] = None) -> list[dict[str, Any]]:
    """Each rule's two implementations on the SAME submitted rows, along ByzFL's own run of that rule.

    At every step of ByzFL's run (:class:`~experiments.bench_byzfl.ByzflDSGD` with the rule's ByzFL
    class) the 8 honest gradients of its clients and the 2 ALIE rows go to the ByzFL server's
    aggregator, whose output the server applies, and to our rule (:func:`experiments.wiring.build_rule`
    of the rule's configuration, as the trainer builds it). One row per rule: ``steps``, ``differ``
    (steps with ``||ours - ByzFL|| > 1e-4 ||ByzFL||``), ``median_rel`` and ``max_rel`` of that relative
    distance, ``other_row`` (steps where the submitted row nearest to each output differs: for Krum,
    a different choice).
    """
    import torch

    from attacks.alie import alie_z

    from .bench_train import build_with_data, compose, overrides
    from .wiring import build_rule

    bz = import_byzfl() if bz is None else bz
    torch.set_num_threads(1)
    out = []
    for rule in rules:
        ours_rule, ours_pre, _, _ = RULES[rule]
        cfg = compose(overrides(n, f, ours_rule, "alie", False, extra=(
            f"preaggregation={ours_pre}", f"data={data}", f"seed={seed}", "optimizer.momentum=0.9", *extra)))
        ours = build_rule(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            trainer, _ = build_with_data(cfg, tmp)
        honest = [r for r in sorted(trainer.shards) if r not in set(trainer.byzantine.ranks)]
        opt = trainer.optimizer.param_groups[0]
        agg, pre = byzfl_rule(rule, f, cfg)
        dsgd = ByzflDSGD(bz, trainer, honest, f=f, lr=float(opt["lr"]), momentum=float(opt["momentum"]),
                         tau=-alie_z(n, f), aggregator=agg, pre_agg=pre)
        torch.manual_seed(int(seed))
        rel, other = [], 0
        for _ in range(steps):
            for c in dsgd.clients:
                c.compute_gradients()
            h = [c.get_flat_gradients_with_momentum() for c in dsgd.clients]
            x = torch.stack(h + dsgd.byz.apply_attack(h))
            t = dsgd.server.aggregate(x.clone())  # what ByzFL's update_model_with_gradients applies
            o = ours(x.clone()).to(x.dtype)
            rel.append(float((o - t).norm() / t.norm().clamp_min(1e-30)))
            other += int(torch.argmin((x - o).norm(dim=1)) != torch.argmin((x - t).norm(dim=1)))
            dsgd.server.set_gradients(t)
            dsgd.server._step()
            dsgd._broadcast()
        out.append({"rule": rule, "steps": steps, "differ": sum(v > 1e-4 for v in rel),
                    "median_rel": statistics.median(rel), "max_rel": max(rel), "other_row": other})
    return out


def verdict(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """Means, standard deviations (ddof 1), the difference, its bound and ``agree`` (see the module docstring).

    ``agree`` is ``|mean_ours - mean_byzfl| <= 2 sqrt(s_ours^2 / k_ours + s_byzfl^2 / k_byzfl)``; ``None``
    when a side has fewer than 2 values.
    """
    out: dict[str, Any] = {"ours_mean": statistics.fmean(ours) if ours else math.nan,
                           "byzfl_mean": statistics.fmean(theirs) if theirs else math.nan,
                           "ours_std": statistics.stdev(ours) if len(ours) > 1 else math.nan,
                           "byzfl_std": statistics.stdev(theirs) if len(theirs) > 1 else math.nan}
    out["diff"] = out["ours_mean"] - out["byzfl_mean"]
    if len(ours) < 2 or len(theirs) < 2:
        out["bound"], out["agree"] = math.nan, None
    else:
        out["bound"] = 2 * math.sqrt(out["ours_std"] ** 2 / len(ours) + out["byzfl_std"] ** 2 / len(theirs))
        out["agree"] = abs(out["diff"]) <= out["bound"]
    return out


def table(rows: Sequence[dict[str, Any]], gaps: Optional[dict[str, dict[int, list[float]]]] = None) -> str:
    """The Markdown table: per rule, ours and ByzFL mean ± std, the difference, its bound and the verdict."""
    gaps = gaps or {}
    lines = ["| rule | ours | ByzFL | ours - ByzFL | bound | agree | max\\|dtheta\\| @1 |",
             "|---|---|---|---|---|---|---|"]
    for rule in dict.fromkeys(r["rule"] for r in rows):
        acc = {s: [r["final_test_acc"] for r in rows if r["rule"] == rule and r["side"] == s]
               for s in ("ours", "byzfl")}
        v = verdict(acc["ours"], acc["byzfl"])
        g = (gaps.get(rule) or {}).get(1) or []
        gap = f"{statistics.fmean(g):.1e}" if g else "-"
        agree = {True: "yes", False: "**no**", None: "-"}[v["agree"]]
        lines.append(f"| {rule} | {v['ours_mean']:.4f} ± {v['ours_std']:.4f} | {v['byzfl_mean']:.4f} ± "
                     f"{v['byzfl_std']:.4f} | {v['diff']:+.4f} | {v['bound']:.4f} | {agree} | {gap} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: run, print the table, write the CSV (and ``--table``); ``2`` (and the how-to) without ByzFL."""
    p = argparse.ArgumentParser(prog="python -m experiments.byzfl_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--f", type=int, default=2)
    p.add_argument("--data", default="fashion_mnist")
    p.add_argument("--sides", nargs="+", choices=["ours", "byzfl"], default=["ours", "byzfl"])
    p.add_argument("--override", nargs="*", default=[],
                   help="extra Hydra overrides of our side (e.g. data.samples=200)")
    p.add_argument("--out", type=Path, default=Path("byzfl_accuracy.csv"), help="the CSV to write")
    p.add_argument("--table", type=Path, default=None, help="also write the command and the table as Markdown here")
    p.add_argument("--diagnose", action="store_true",
                   help="instead: the parameter gap between the sides along the run (first seed) and each rule's "
                        "two implementations on the same rows (:func:`same_rows`); printed, and written to --table")
    a = p.parse_args(argv)
    bz = None
    if "byzfl" in a.sides:
        try:
            bz = import_byzfl()
        except ByzflMissing as exc:
            print(f"error: {str(exc).replace('experiments.bench_byzfl', 'experiments.byzfl_accuracy')}",
                  file=sys.stderr)
            return 2
    warnings.simplefilter("ignore")  # the trainer's advisories
    import pandas as pd

    from .bench import machine, write_csv

    command = "python -m experiments.byzfl_accuracy " + " ".join(shlex.quote(x) for x in
                                                                  (sys.argv[1:] if argv is None else argv))
    if bz is not None:
        command = f"PYTHONPATH={Path(sys.modules['byzfl'].__path__[0]).parent}:$PWD {command}"
    if a.diagnose:
        if bz is None:
            print("error: --diagnose compares both sides; drop --sides", file=sys.stderr)
            return 2
        trace = sorted({1, 10, 25, 50, 100, a.steps} & set(range(1, a.steps + 1)))
        _, gaps = run(rules=a.rules, seeds=a.seeds[:1], steps=a.steps, n=a.n, f=a.f, data=a.data, extra=a.override,
                      bz=bz, trace=trace)
        lines = ["| rule | " + " | ".join(f"step {t}" for t in trace) + " |", "|---|" + "---|" * len(trace)]
        lines += [f"| {r} | " + " | ".join(f"{gaps[r][t][0]:.1e}" for t in trace) + " |" for r in a.rules]
        same = same_rows(rules=a.rules, seed=a.seeds[0], steps=a.steps, n=a.n, f=a.f, data=a.data,
                         extra=a.override, bz=bz)
        lines += ["", "| rule | steps | steps differing (> 1e-4 rel.) | median rel. | max rel. | other nearest row |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['rule']} | {d['steps']} | {d['differ']} | {d['median_rel']:.1e} | {d['max_rel']:.1e} | "
                  f"{d['other_row']} |" for d in same]
        text = (f"max |theta_ours - theta_byzfl| after step t (seed {a.seeds[0]}); then each rule's two "
                f"implementations on the same rows along ByzFL's run of that rule:\n\n" + "\n".join(lines))
        print(text)
        if a.table is not None:
            a.table.parent.mkdir(parents=True, exist_ok=True)
            a.table.write_text(f"`{command}`\n\n{text}\n")
            print(f"wrote {a.table}")
        return 0
    rows, gaps = run(rules=a.rules, seeds=a.seeds, steps=a.steps, n=a.n, f=a.f, data=a.data, sides=a.sides,
                     extra=a.override, bz=bz, log=sys.stdout)
    head = (f"{machine()}; byzfl {bz.version if bz else 'not used'}; data={a.data}, n={a.n}, f={a.f} (ALIE), "
            f"batch 32, SGD lr 0.1 momentum 0.9, {a.steps} steps, seeds {a.seeds}")
    text = table(rows, gaps)
    notes = "\n".join(f"- {k}: {v}" for k, v in CONVENTIONS.items() if k == "alie" or k in a.rules)
    print(f"\n{head}\n\n{text}\n\nagree: |ours - ByzFL| <= 2 sqrt(s_ours^2/k + s_byzfl^2/k) (two standard errors)\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(pd.DataFrame(rows, columns=COLUMNS), a.out)
    print(f"wrote {a.out}")
    if a.table is not None:
        a.table.write_text(f"`{command}`\n\n{head}\n\n{text}\n\nagree: |ours - ByzFL| <= 2 sqrt(s_ours^2/k + "
                           f"s_byzfl^2/k) (two standard errors of the difference of the means, k seeds a side)\n\n"
                           f"Conventions (ours vs ByzFL):\n\n{notes}\n")
        print(f"wrote {a.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
