"""Reading a sweep: every run's resolved config, ``summary.json`` and ``metrics.jsonl``, into pandas.

A *run* is a folder holding Hydra's ``.hydra/config.yaml`` (found at any depth under the sweep
folder). From it the report takes:

- the run's identity and its ``context`` key (:mod:`experiments.report_config`);
- ``status``: ``ok`` (a final evaluation exists); for a run the trainer refused or stopped (it
  wrote ``skipped.json`` with the reason and the exception type), :func:`classify` tells
  ``skipped`` (a requirement is broken: the sweep went on, as intended), ``diverged`` (non-finite
  values during training: scored at chance accuracy), ``invalid`` (a bad configuration value) or
  ``failed``; ``missing`` when there is no final evaluation and no record (crashed or still
  running; the reason names the requirement the config breaks, if any);
- final and worst-class accuracy (last ``kind="test"`` record of ``metrics.jsonl``, else
  ``summary.json``), mean kappa-hat, Byzantine-accepted rate, steps, wall time;
- three long tables: kappa-hat per training step, each honest worker's mean weight with its label
  skew (total-variation distance of its label histogram from the pool's), and the learning curve
  (test accuracy and loss at every evaluation).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pandas as pd
from omegaconf import OmegaConf

from robustagg.errors import ConfigError

from .report_config import IDENTITY_KEYS, describe_run, disambiguate, load_config

CURVE_COLUMNS = ["run_id", "step", "acc", "loss"]

__all__ = ["SweepData", "find_runs", "load_sweep", "load_run", "learning_curve", "read_metrics", "classify", "write_atomic",
           # re-exported from report_config
           "load_config", "describe_run", "IDENTITY_KEYS"]


@dataclass
class SweepData:
    """Everything the report needs from a sweep folder.

    Attributes:
        runs: one row per run (see the module docstring for the columns).
        kappa: long table ``run_id, step, kappa_hat`` (train records with a finite kappa-hat).
        weights: long table ``run_id, worker, weight, rel_weight, label_skew`` (honest workers' mean
            weight over the training steps; ``rel_weight = n * weight``, 1 = a fair share).
        root: the sweep folder.
        curves: long table ``run_id, step, acc, loss`` (every evaluation: test accuracy as a
            fraction, mean test cross-entropy in nats).
    """

    runs: pd.DataFrame
    kappa: pd.DataFrame
    weights: pd.DataFrame
    root: Path
    curves: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=CURVE_COLUMNS))


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> Path:
    """:func:`robustagg.training.atomic_write` (temp file, fsync, rename) with the file made
    readable like any new file (``0o666`` less the umask) instead of ``mkstemp``'s ``0o600``."""
    from robustagg.training import atomic_write

    mask = os.umask(0)
    os.umask(mask)

    def wrapped(tmp: str) -> None:
        write(tmp)
        os.chmod(tmp, 0o666 & ~mask)

    return atomic_write(path, wrapped)


def find_runs(root: str | os.PathLike[str]) -> list[Path]:
    """Every folder under ``root`` (itself included) holding ``.hydra/config.yaml``, sorted."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"the sweep folder {str(base)!r} does not exist; pass the multirun directory Hydra printed "
                          f"(e.g. multirun/2024-01-01/12-00-00).")
    return sorted({p.parent.parent for p in base.rglob(".hydra/config.yaml")}, key=_natural)


def _natural(p: Path) -> tuple:
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.parts)


def _requirement_violations(rule: str, n: int, f: int) -> list[str]:
    try:
        import robustagg as ra

        return list(ra.get(rule, f=f, strict=False).requirement.check(n, f)) if rule != "mean" else []
    except Exception:  # noqa: BLE001 - unknown rule names are reported as such by the trainer
        return []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
        return obj if isinstance(obj, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def read_metrics(path: Path) -> pd.DataFrame:
    """``metrics.jsonl`` as a DataFrame (strings ``"inf"``/``"-inf"`` become floats); empty if absent."""
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    good = []
    for ln in lines:  # a torn last line of a crashed run is skipped, not fatal
        try:
            good.append(json.loads(ln))
        except json.JSONDecodeError:
            continue
    df = pd.DataFrame.from_records(good)
    for col in df.columns:
        if col not in ("kind",) and df[col].dtype == object:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if "kind" not in df.columns:
        df["kind"] = ["test" if "test/acc" in r else "train" for r in good]
    return df


def classify(record: dict[str, Any]) -> str:
    """Status of a run the trainer did not finish, from its ``skipped.json`` (``reason``, ``type``):

    - ``skipped``: the configuration breaks a rule's requirement (``AssumptionError``), or the
      attack cannot run in this setting (a ``ConfigError`` whose reason says so);
    - ``diverged``: training produced non-finite values (``NonFiniteInputError``, or ``status:
      diverged``); the report scores such a run at chance accuracy ``1/C`` (worst class 0);
    - ``invalid``: any other configuration error (a sweep that sets a bad value: fix the sweep);
    - ``failed``: anything else.

    Example:
        >>> classify({"type": "AssumptionError", "reason": "Bulyan requires n >= 4f + 3"})
        'skipped'
        >>> classify({"type": "ConfigError", "reason": "trainer.lr must be > 0; got 0."})
        'invalid'
    """
    kind = str(record.get("type", ""))
    reason = str(record.get("reason", ""))
    status = str(record.get("status", "")).lower()
    if status == "diverged" or kind in ("NonFiniteInputError",) or "non-finite" in reason:
        return "diverged"
    if kind in ("AssumptionError", "") or (kind == "ConfigError" and "cannot run" in reason):
        return "skipped"
    if kind == "ConfigError":
        return "invalid"
    return "failed"


def _num_classes(cfg: dict[str, Any]) -> int:
    data = cfg.get("data") or {}
    if str(data.get("name", "digits")) == "synthetic":
        return max(1, int(data.get("num_classes", 10) or 10))
    return 10  # digits


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def _label_skew(cfg: dict[str, Any], summary: dict[str, Any], cache: dict[str, list[float]]) -> list[float]:
    for key in ("label_skew", "worker_label_skew"):
        if isinstance(summary.get(key), list):
            return [_num(v) for v in summary[key]]
    data = cfg.get("data") or {}
    threat = cfg.get("threat") or {}
    n = int(threat.get("n", 0) or 0)
    byz = int(threat.get("byzantine", threat.get("f", 0)) or 0)
    ranks = threat.get("ranks") or list(range(n - byz, n))
    key = json.dumps([data, n, ranks, cfg.get("seed")], sort_keys=True, default=str)
    if key not in cache:
        try:
            from experiments.data import build_data

            bundle = build_data(OmegaConf.create(data), n=n, byzantine_ranks=[int(r) for r in ranks],
                                seed=int(cfg.get("seed", 0) or 0))
            cache[key] = bundle.label_skew()
        except Exception:  # noqa: BLE001 - the skew is a diagnostic; without it the plot has a gap
            cache[key] = [math.nan] * n
    return cache[key]


def learning_curve(metrics: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """The ``kind="test"`` records of one run's metrics as ``run_id, step, acc, loss`` (sorted by step)."""
    test = metrics[metrics["kind"] == "test"] if "kind" in metrics and "test/acc" in metrics else metrics.iloc[0:0]
    if not len(test):
        return pd.DataFrame(columns=CURVE_COLUMNS)
    loss = test["test/loss"] if "test/loss" in test else pd.Series(math.nan, index=test.index)
    out = pd.DataFrame({"run_id": run_id, "step": test["step"].astype(int), "acc": test["test/acc"].map(_num),
                        "loss": loss.map(_num)})
    return out.sort_values("step").reset_index(drop=True)


def load_run(run: Path, run_id: str, skew_cache: dict[str, list[float]]) -> tuple[dict[str, Any], pd.DataFrame,
                                                                                  pd.DataFrame]:
    """One run: its row of the runs table, its kappa-hat curve and its honest workers' weights
    (its learning curve: :func:`learning_curve`)."""
    cfg = load_config(run)
    row: dict[str, Any] = {"run_id": run_id, "run_dir": str(run)}
    row.update(describe_run(cfg))
    summary = _read_json(run / "summary.json")
    metrics = read_metrics(run / "metrics.jsonl")
    test = metrics[metrics["kind"] == "test"] if "kind" in metrics else metrics.iloc[0:0]
    train = metrics[metrics["kind"] == "train"] if "kind" in metrics else metrics.iloc[0:0]
    last = test.sort_values("step").iloc[-1] if len(test) and "test/acc" in test else None
    row["final_acc"] = _num(last["test/acc"]) if last is not None else _num(summary.get("final_test_acc"))
    row["worst_class_acc"] = (_num(last.get("test/worst_class_acc")) if last is not None
                              else _num(summary.get("worst_class_acc")))
    row["final_loss"] = _num(last.get("test/loss")) if last is not None else _num(summary.get("final_test_loss"))
    row["best_acc"] = _num(test["test/acc"].max()) if last is not None else _num(summary.get("best_test_acc"))
    # backdoor attack success rate (test/asr, in [0, 1]) of the last evaluation; nan for other attacks
    row["final_asr"] = (_num(last.get("test/asr")) if last is not None and "test/asr" in test
                        else _num(summary.get("final_test_asr")))
    kap = train["agg/kappa_hat"] if "agg/kappa_hat" in train else pd.Series(dtype=float)
    finite = kap[kap.map(lambda v: math.isfinite(v) if isinstance(v, float) else False)]
    row["mean_kappa_hat"] = _num(finite.mean()) if len(finite) else _num(summary.get("mean_kappa_hat"))
    acc = train["agg/byz_accepted"].dropna() if "agg/byz_accepted" in train else pd.Series(dtype=float)
    row["byz_accepted"] = _num(acc.mean()) if len(acc) else _num(summary.get("byz_accepted_rate"))
    row["steps"] = int(train["step"].max()) if len(train) else int(summary.get("steps", 0) or 0)
    for key in ("mean_bias_vs_sync", "mean_bias_vs_sync_rel", "mean_staleness", "rounds_without_guarantee"):
        col = {"mean_bias_vs_sync": "agg/bias_vs_sync", "mean_bias_vs_sync_rel": "agg/bias_vs_sync_rel",
               "mean_staleness": "round/staleness_mean", "rounds_without_guarantee": "round/over_f"}[key]
        if col in train and train[col].notna().any():
            vals = pd.to_numeric(train[col], errors="coerce")
            row[key] = _num(vals.sum() if key == "rounds_without_guarantee" else vals.mean())
        else:
            row[key] = _num(summary.get(key))
    row["wall_seconds"] = _num(summary.get("wall_seconds"))
    skipped = _read_json(run / "skipped.json")
    if str(summary.get("status", "")).lower() in ("skipped", "diverged"):
        skipped = summary
    if skipped:
        row["status"] = classify(skipped)
        row["reason"] = str(skipped.get("reason", "no reason recorded"))
        if row["status"] == "diverged":  # scored at chance: a model with non-finite weights predicts nothing
            row["final_acc"] = 1.0 / _num_classes(cfg)
            row["worst_class_acc"] = 0.0
    elif math.isfinite(row["final_acc"]):
        row["status"], row["reason"] = "ok", ""
    else:
        broken = _requirement_violations(row["rule"], row["n"], row["f"])
        why = " ".join(broken) if broken else "no final evaluation (crashed, killed, or still running)"
        row["status"], row["reason"] = "missing", why
    kappa = pd.DataFrame({"run_id": run_id, "step": train["step"], "kappa_hat": kap}) if len(kap) else \
        pd.DataFrame(columns=["run_id", "step", "kappa_hat"])
    kappa = kappa[kappa["kappa_hat"].map(lambda v: isinstance(v, float) and math.isfinite(v))]
    wcols = [c for c in train.columns if str(c).startswith("agg/honest_weight/")]
    weights = pd.DataFrame(columns=["run_id", "worker", "weight", "rel_weight", "label_skew"])
    if wcols and row["status"] == "ok":
        skew = _label_skew(cfg, summary, skew_cache)
        recs = []
        for c in wcols:
            w = int(str(c).rsplit("/", 1)[1])
            mean_w = _num(train[c].mean())
            recs.append({"run_id": run_id, "worker": w, "weight": mean_w, "rel_weight": row["n"] * mean_w,
                         "label_skew": skew[w] if w < len(skew) else math.nan})
        weights = pd.DataFrame.from_records(recs)
    return row, kappa, weights


def load_sweep(root: str | os.PathLike[str], runs: Optional[Iterable[Path]] = None) -> SweepData:
    """Read every run under ``root`` (see the module docstring).

    Raises:
        ConfigError: ``root`` does not exist or holds no run.
    """
    base = Path(root)
    found = list(runs) if runs is not None else find_runs(base)
    if not found:
        raise ConfigError(f"no run found under {str(base)!r}: expected folders with .hydra/config.yaml "
                          f"(a Hydra multirun directory).")
    rows, kappas, weights, curves = [], [], [], []
    cache: dict[str, list[float]] = {}
    for path in found:
        rid = str(path.relative_to(base)) if path != base else "."
        row, kap, w = load_run(path, rid, cache)
        rows.append(row)
        kappas.append(kap)
        weights.append(w)
        curves.append(learning_curve(read_metrics(path / "metrics.jsonl"), rid))
    kappa = pd.concat([k for k in kappas if len(k)], ignore_index=True) if any(len(k) for k in kappas) else \
        pd.DataFrame(columns=["run_id", "step", "kappa_hat"])
    wt = pd.concat([w for w in weights if len(w)], ignore_index=True) if any(len(w) for w in weights) else \
        pd.DataFrame(columns=["run_id", "worker", "weight", "rel_weight", "label_skew"])
    table = pd.DataFrame.from_records(rows)
    table["rule"] = disambiguate(table["rule"], table["rule_params"])
    table["attack"] = disambiguate(table["attack"], table["attack_params"])
    curve = pd.concat([c for c in curves if len(c)], ignore_index=True) if any(len(c) for c in curves) else \
        pd.DataFrame(columns=CURVE_COLUMNS)
    return SweepData(runs=table, kappa=kappa, weights=wt, root=base, curves=curve)
