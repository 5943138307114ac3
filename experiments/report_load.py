"""Reading a sweep: every run's resolved config, ``summary.json`` and ``metrics.jsonl``, into pandas.

A *run* is a folder holding Hydra's ``.hydra/config.yaml`` (found at any depth under the sweep
folder). From it the report takes:

- the run's identity: ``rule`` (pre-aggregation stages then the rule, joined by ``>``, e.g.
  ``bucketing>coordinate_median``), ``attack`` (``none`` when no attack is configured),
  ``heterogeneity`` (``iid``, ``dirichlet(a=0.1)``, ...), ``seed``, ``n``, ``f``, ``byzantine``;
- a ``context`` key: every config value except those that choose the rule, the attack or only the
  logging, so that a run is compared only with runs trained on the same data, model, trainer
  and seed (:data:`IDENTITY_KEYS` lists what is left out);
- ``status``: ``ok`` (a final evaluation exists); for a run the trainer refused or stopped (it
  wrote ``skipped.json`` with the reason and the exception type), :func:`classify` tells
  ``skipped`` (a requirement is broken: the sweep went on, as intended), ``diverged`` (non-finite
  values during training: scored at chance accuracy), ``invalid`` (a bad configuration value) or
  ``failed`` or ``missing`` (no final evaluation: crashed or
  still running; the reason says what is known, including the requirement the config breaks);
- final and worst-class accuracy (last ``kind="test"`` record of ``metrics.jsonl``, else
  ``summary.json``), mean kappa-hat, Byzantine-accepted rate, steps, wall time;
- two long tables: kappa-hat per training step, and each honest worker's mean weight with its label
  skew (total-variation distance of its label histogram from the pool's).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pandas as pd
from omegaconf import OmegaConf

from robustagg.errors import ConfigError

__all__ = ["SweepData", "find_runs", "load_config", "describe_run", "load_sweep", "classify", "IDENTITY_KEYS"]

#: Config prefixes that pick the rule, the attack or only change logging: left out of ``context``.
IDENTITY_KEYS = ("aggregator", "preaggregation", "attack", "threat.byzantine", "threat.ranks", "threat.start_step",
                 "strict", "logger", "out_dir", "trainer.progress", "trainer.port", "trainer.master_addr",
                 "trainer.metrics", "trainer.skip_invalid", "trainer.threads", "trainer.start_method",
                 "trainer.collective_timeout_s", "trainer.mode", "trainer.backend", "trainer.device",
                 "trainer.param_check_every", "trainer.eval_every", "trainer.reduction", "trainer.checkpoint",
                 "trainer.resume", "trainer.max_restarts", "trainer.on_failure", "trainer.shrink_shards",
                 "trainer.straggler_factor", "seed", "hydra")


@dataclass
class SweepData:
    """Everything the report needs from a sweep folder.

    Attributes:
        runs: one row per run (see the module docstring for the columns).
        kappa: long table ``run_id, step, kappa_hat`` (train records with a finite kappa-hat).
        weights: long table ``run_id, worker, weight, rel_weight, label_skew`` (honest workers' mean
            weight over the training steps; ``rel_weight = n * weight``, 1 = a fair share).
        root: the sweep folder.
    """

    runs: pd.DataFrame
    kappa: pd.DataFrame
    weights: pd.DataFrame
    root: Path


def find_runs(root: str | os.PathLike[str]) -> list[Path]:
    """Every folder under ``root`` (itself included) holding ``.hydra/config.yaml``, sorted."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"the sweep folder {str(base)!r} does not exist; pass the multirun directory Hydra printed "
                          f"(e.g. multirun/2024-01-01/12-00-00).")
    return sorted({p.parent.parent for p in base.rglob(".hydra/config.yaml")}, key=_natural)


def _natural(p: Path) -> tuple:
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.parts)


def load_config(run: Path) -> dict[str, Any]:
    """The run's config as a plain dict, interpolations resolved.

    The trainer's ``config_resolved.yaml`` (the schema's defaults filled in) is used when the run
    wrote one; otherwise Hydra's ``.hydra/config.yaml`` (a run refused before training). There,
    ``${hydra:...}`` is looked up in the run's own ``.hydra/hydra.yaml``; a value that still
    cannot be resolved is kept as its unresolved text.
    """
    resolved = run / "config_resolved.yaml"
    if resolved.exists():
        data = OmegaConf.to_container(OmegaConf.load(resolved), resolve=False)
        if isinstance(data, dict) and data:
            return {str(k): v for k, v in data.items()}
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    hydra_file = run / ".hydra" / "hydra.yaml"
    if hydra_file.exists():
        hcfg = OmegaConf.load(hydra_file)
        cfg = OmegaConf.merge(cfg, hcfg)  # ${hydra:x} then reads hydra.x below
    text = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(text, dict)
    out = _resolve(cfg, text, "")
    out.pop("hydra", None)
    return out


def _resolve(cfg: Any, node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        return {k: _resolve(cfg, v, f"{prefix}{k}.") for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(cfg, v, prefix) for v in node]
    if isinstance(node, str) and "${" in node:
        key = prefix[:-1]
        try:
            return OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except Exception:  # noqa: BLE001 - an unknown resolver (e.g. ${hydra:...}) keeps its text
            return _hydra_lookup(cfg, node)
    return node


def _hydra_lookup(cfg: Any, text: str) -> Any:
    if text.startswith("${hydra:") and text.endswith("}") and text.count("${") == 1:
        return OmegaConf.select(cfg, "hydra." + text[len("${hydra:"):-1], default=text)
    return text


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become JSON text so they can be compared."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        if not d and prefix:
            out[prefix[:-1]] = "{}"
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list):
        out[prefix[:-1]] = json.dumps(d, sort_keys=True)
    else:
        out[prefix[:-1]] = d
    return out


def _registry_name(node: Any, lookup_class: Callable[[str], Optional[str]]) -> Optional[str]:
    if node is None or node == "none":
        return None
    if isinstance(node, str):
        return node
    if isinstance(node, list):
        names = [_registry_name(x, lookup_class) for x in node]
        return ">".join(n for n in names if n) or None
    if isinstance(node, dict):
        for key in ("name", "_name_"):
            if isinstance(node.get(key), str) and node[key] not in ("", "none"):
                return str(node[key])
        target = node.get("_target_")
        if isinstance(target, str):
            return lookup_class(target) or target.rsplit(".", 1)[-1]
        if node.get("enabled") is False:
            return None
    return None


def _class_name(target: str) -> Optional[str]:
    """Registry name of the class at dotted path ``target`` (``robustagg.Krum`` -> ``krum``)."""
    import importlib

    mod, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    name = getattr(cls, "name", None)
    return name if isinstance(name, str) else None


def heterogeneity_label(data: dict[str, Any]) -> str:
    """Short label of how the data is split: ``iid``, ``dirichlet(a=0.1)``, ``label_sorted(2 shards)``,
    ``long_tail(x10)``; synthetic feature shift appends ``+shift=h``.

    Example:
        >>> heterogeneity_label({"partition": "dirichlet", "alpha": 0.1})
        'dirichlet(a=0.1)'
    """
    part = str(data.get("partition", "iid"))
    if part == "dirichlet":
        label = f"dirichlet(a={float(data.get('alpha', math.nan)):g})"
    elif part == "label_sorted":
        label = f"label_sorted({data.get('shards_per_worker', '?')} shards)"
    elif part == "long_tail":
        label = f"long_tail(x{float(data.get('imbalance', math.nan)):g})"
    else:
        label = part
    het = data.get("heterogeneity")
    if data.get("name") == "synthetic" and isinstance(het, (int, float)) and het > 0:
        label += f"+shift={het:g}"
    return label


def describe_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The identity columns of one run from its resolved config (see the module docstring)."""
    threat = cfg.get("threat") or {}
    data = cfg.get("data") or {}
    pre = _registry_name(cfg.get("preaggregation"), _class_name)
    rule = _registry_name(cfg.get("aggregator"), _class_name) or "?"
    if pre and ">" not in rule:
        rule = f"{pre}>{rule}"
    attack = _registry_name(cfg.get("attack"), _attack_name) or "none"
    n = int(threat.get("n", 0) or 0)
    f = int(threat.get("f", 0) or 0)
    byz_raw = threat.get("byzantine", f)
    byz = int(byz_raw) if isinstance(byz_raw, (int, float)) else f
    if attack == "none":
        byz = 0
    setting = {k: v for k, v in flatten(cfg).items() if not _is_identity(k)}
    seed = int(cfg.get("seed", 0) or 0)
    context = _digest({**setting, "seed": seed})
    return {"rule": rule, "attack": attack, "heterogeneity": heterogeneity_label(data),
            "data": str(data.get("name", "?")), "seed": seed, "n": n, "f": f, "byzantine": byz,
            "context": context, "setting_key": _digest(setting),
            "logger": str((cfg.get("logger") or {}).get("name", "none")),
            "group": (cfg.get("logger") or {}).get("group"),
            "project": (cfg.get("logger") or {}).get("project"),
            "setting_json": json.dumps(setting, sort_keys=True, default=str),
            "rule_params": json.dumps(_params(cfg.get("preaggregation"), cfg.get("aggregator")), sort_keys=True,
                                      default=str),
            "attack_params": json.dumps(_params(cfg.get("attack")), sort_keys=True, default=str)}


def _params(*nodes: Any) -> dict[str, Any]:
    """Hyperparameters of the rule/attack nodes, minus the threat values (n, f) they interpolate."""
    out: dict[str, Any] = {}
    for i, node in enumerate(nodes):
        for k, v in flatten(node if isinstance(node, (dict, list)) else {}).items():
            if k.rsplit(".", 1)[-1] not in ("f", "n", "num_byzantine", "_target_", "name", "_name_"):
                out[f"{i}.{k}"] = v
    return out


def _is_identity(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in IDENTITY_KEYS)


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _attack_name(target: str) -> Optional[str]:
    return _class_name(target)


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


def load_run(run: Path, run_id: str, skew_cache: dict[str, list[float]]) -> tuple[dict[str, Any], pd.DataFrame,
                                                                                  pd.DataFrame]:
    """One run: its row of the runs table, its kappa-hat curve and its honest workers' weights."""
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
    kap = train["agg/kappa_hat"] if "agg/kappa_hat" in train else pd.Series(dtype=float)
    finite = kap[kap.map(lambda v: math.isfinite(v) if isinstance(v, float) else False)]
    row["mean_kappa_hat"] = _num(finite.mean()) if len(finite) else _num(summary.get("mean_kappa_hat"))
    acc = train["agg/byz_accepted"].dropna() if "agg/byz_accepted" in train else pd.Series(dtype=float)
    row["byz_accepted"] = _num(acc.mean()) if len(acc) else _num(summary.get("byz_accepted_rate"))
    row["steps"] = int(train["step"].max()) if len(train) else int(summary.get("steps", 0) or 0)
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
    rows, kappas, weights = [], [], []
    cache: dict[str, list[float]] = {}
    for path in found:
        rid = str(path.relative_to(base)) if path != base else "."
        row, kap, w = load_run(path, rid, cache)
        rows.append(row)
        kappas.append(kap)
        weights.append(w)
    kappa = pd.concat([k for k in kappas if len(k)], ignore_index=True) if any(len(k) for k in kappas) else \
        pd.DataFrame(columns=["run_id", "step", "kappa_hat"])
    wt = pd.concat([w for w in weights if len(w)], ignore_index=True) if any(len(w) for w in weights) else \
        pd.DataFrame(columns=["run_id", "worker", "weight", "rel_weight", "label_skew"])
    table = pd.DataFrame.from_records(rows)
    table["rule"] = disambiguate(table["rule"], table["rule_params"])
    table["attack"] = disambiguate(table["attack"], table["attack_params"])
    return SweepData(runs=table, kappa=kappa, weights=wt, root=base)


def disambiguate(names: pd.Series, params: pd.Series) -> pd.Series:
    """Append ``[k=v,...]`` to a name used with different hyperparameters (the keys that differ).

    Example:
        >>> import pandas as pd
        >>> disambiguate(pd.Series(["krum", "cm", "cm"]), pd.Series(["{}", '{"1.s": 2}', '{"1.s": 3}'])).tolist()
        ['krum', 'cm[s=2]', 'cm[s=3]']
    """
    out = names.copy()
    for name in names.unique():
        sel = names == name
        variants = {p: json.loads(p) for p in params[sel].unique()}
        if len(variants) < 2:
            continue
        keys = sorted({k for v in variants.values() for k in v})
        differ = [k for k in keys if len({json.dumps(v.get(k), default=str) for v in variants.values()}) > 1]
        for p, v in variants.items():
            tag = ",".join(f"{k.split('.', 1)[-1]}={v.get(k)}" for k in differ)
            out[sel & (params == p)] = f"{name}[{tag}]"
    return out
