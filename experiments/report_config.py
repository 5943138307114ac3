"""Reading a run's configuration: resolve it, name its rule and attack, key its context.

From a run's resolved config the report takes the run's identity: ``rule`` (pre-aggregation
stages then the rule, joined by ``>``, e.g. ``bucketing>coordinate_median``), ``attack`` (``none``
when no attack is configured), ``heterogeneity`` (``iid``, ``dirichlet(a=0.1)``, ...), ``seed``,
``n``, ``f``, ``byzantine``; and a ``context`` key: every config value except those that choose the
rule, the attack, or only how the run is executed and logged (:data:`IDENTITY_KEYS`), so that a run
is compared only with runs trained on the same data, model, trainer settings and seed.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
from omegaconf import OmegaConf

__all__ = ["IDENTITY_KEYS", "load_config", "flatten", "heterogeneity_label", "describe_run", "disambiguate"]

#: Config prefixes that pick the rule, the attack or only change logging: left out of ``context``.
IDENTITY_KEYS = ("aggregator", "preaggregation", "attack", "threat.byzantine", "threat.ranks", "threat.start_step",
                 "strict", "logger", "out_dir", "trainer.progress", "trainer.port", "trainer.master_addr",
                 "trainer.metrics", "trainer.skip_invalid", "trainer.threads", "trainer.start_method",
                 "trainer.collective_timeout_s", "trainer.mode", "trainer.backend", "trainer.device",
                 "trainer.param_check_every", "trainer.eval_every", "trainer.reduction", "trainer.checkpoint",
                 "trainer.resume", "trainer.max_restarts", "trainer.on_failure", "trainer.shrink_shards",
                 "trainer.straggler_factor", "seed", "hydra",
                 "protocol.node_rule")  # under protocol=gossip the node rule is the run's rule (describe_run)



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
    """Short label of how the data is split (:func:`experiments.config.partition_label`, the one
    definition, shared with the run names and W&B tags).

    Example:
        >>> heterogeneity_label({"partition": "dirichlet", "alpha": 0.1})
        'dirichlet(a=0.1)'
    """
    from .config import partition_label

    return partition_label(data)


def describe_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The identity columns of one run from its resolved config (see the module docstring)."""
    threat = cfg.get("threat") or {}
    data = cfg.get("data") or {}
    pre = _registry_name(cfg.get("preaggregation"), _class_name)
    rule = _registry_name(cfg.get("aggregator"), _class_name) or "?"
    if pre and ">" not in rule:
        rule = f"{pre}>{rule}"
    proto_node = cfg.get("protocol") or {}
    if str(proto_node.get("_target_", "")).endswith(".Gossip"):  # no server rule: the node rule is the run's rule
        rule = f"gossip:{proto_node.get('node_rule')}"
    attack = _registry_name(cfg.get("attack"), _attack_name) or "none"
    n = int(threat.get("n", 0) or 0)
    f = int(threat.get("f", 0) or 0)
    byz_raw = threat.get("byzantine", f)
    byz = int(byz_raw) if isinstance(byz_raw, (int, float)) else f
    if attack == "none":
        byz = 0
    setting = {k: v for k, v in flatten(cfg).items() if not _is_identity(k)}
    seed = int(cfg.get("seed", 0) or 0)
    proto = protocol_axes(cfg.get("protocol"), n)
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
            "attack_params": json.dumps(_params(cfg.get("attack")), sort_keys=True, default=str), **proto}


def protocol_axes(node: Any, n: int) -> dict[str, Any]:
    """The availability axes of a run's ``protocol`` node: ``protocol`` (its class name, lower case),
    ``participation`` (rounds with client sampling: the fraction of the n clients sampled per round,
    ``clients_per_round / n`` under uniform sampling, else 1; dsgd: 1; other protocols: NaN) and
    ``tau`` (an asynchronous protocol's ``max_staleness``; dsgd: 0; other protocols: NaN)."""
    node = node if isinstance(node, dict) else {}
    target = str(node.get("_target_") or "robustagg.protocols.DSGD")
    name = target.rsplit(".", 1)[-1].lower()
    k = node.get("clients_per_round")
    part, tau = (1.0, 0.0) if name == "dsgd" else (math.nan, math.nan)
    if isinstance(k, (int, float)) and n > 0:
        part = 1.0 if str(node.get("sampling", "uniform")) == "all" else min(1.0, float(k) / n)
    t = node.get("max_staleness")
    if isinstance(t, (int, float)):
        tau = float(t)
    return {"protocol": name, "participation": part, "tau": tau}


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
