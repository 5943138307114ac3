"""Byzantine-robust consensus on a graph: every node rule against every gossip attack (issue 30).

``python -m experiments.gossip_consensus`` (config ``conf/gossip_consensus``) runs the consensus
experiment of He, Karimireddy and Jaggi (2022, Sec. 5, "consensus"): no data and no gradient,
every node starts from its own model drawn from N(0, I_d) (seeded) and only mixes, for ``rounds``
rounds, with :func:`robustagg.decentralised.gossip.gossip_round`. With honest nodes only, every
rule should bring them to one point; the attacks try to keep them apart (dissensus, split) or drag
them away (ALIE, IPM, sign flip). One row per (topology, rule, attack) (:data:`COLUMNS`):

- ``byzantine``: the Byzantine nodes (``attack=none``: none, everyone honest); ``node_f``: the
  bound every node rule is given (a topology's own ``node_f``, else the top-level one);
- ``attack``: its name and parameters (``dissensus epsilon=1.05``);
- ``spectral_gap``, ``delta_max``: the honest subgraph's gap and the largest Byzantine gossip
  weight at an honest node (:func:`robustagg.decentralised.exposure.exposure`);
- ``consensus_start`` / ``consensus_end``: the honest consensus distance before the first and after
  the last round; ``drift``: how far the honest nodes' mean moved (``||xbar_H(T) - xbar_H(0)||``;
  plain gossip with Metropolis weights keeps it at 0 when nobody attacks);
- ``kappa_mean`` / ``kappa_max``: the last round's empirical robustness coefficient over the
  honest nodes (:func:`~robustagg.decentralised.gossip.gossip_round`);
- ``status``: ``ok``, ``diverged`` (a non-finite model or a consensus distance above 1e12) or
  ``refused: <reason>`` (the per-node requirement check, strict).

Results go to ``gossip_consensus.csv`` in the Hydra run directory; ``docs/decentralised.md`` quotes
the committed copy ``docs/results/gossip_consensus.csv``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from attacks.gossip import build_gossip_attack
from robustagg.decentralised import graph as graphs
from robustagg.decentralised.exposure import exposure
from robustagg.decentralised.gossip import consensus_distance, gossip_round
from robustagg.decentralised.rules import build_node_rule
from robustagg.errors import AssumptionError, ConfigError

COLUMNS = ["topology", "nodes", "byzantine", "placement", "node_f", "rule", "attack", "rounds", "spectral_gap",
           "delta_max", "consensus_start", "consensus_end", "drift", "kappa_mean", "kappa_max", "status"]

#: a consensus distance above this counts as diverged.
DIVERGED = 1e12


def run_cell(topology: dict[str, Any], rule_name: str, attack_spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """One (topology, rule, attack) consensus run; the :data:`COLUMNS` row."""
    g = graphs.build(topology["name"], int(topology["nodes"]), seed=int(cfg["seed"]),
                     edge_probability=float(topology.get("edge_probability", 0.5)),
                     torus_rows=int(topology.get("torus_rows", 0)))
    attack_name = str(attack_spec["name"])
    f = 0 if attack_name == "none" else int(topology["byzantine"])
    byz = graphs.place_byzantine(g, f, str(topology["placement"]), seed=int(cfg["seed"]))
    rule = build_node_rule(rule_name, clip_radius=float(cfg["clip_radius"]))
    node_f = int(topology.get("node_f", cfg["node_f"]))
    params = {k: v for k, v in attack_spec.items() if k != "name"}
    label = attack_name + "".join(f" {k}={v}" for k, v in params.items())
    row: dict[str, Any] = {"topology": g.name, "nodes": g.num_nodes, "byzantine": " ".join(map(str, byz)),
                           "placement": topology["placement"], "node_f": node_f, "rule": rule_name,
                           "attack": label, "rounds": int(cfg["rounds"])}
    rep = exposure(g, byz, rule, node_f=node_f, weighting=str(cfg["weights"]))
    row.update(spectral_gap=rep["spectral_gap"], delta_max=rep["byzantine_weight_max"])
    nan = {k: math.nan for k in ("consensus_start", "consensus_end", "drift", "kappa_mean", "kappa_max")}
    if rep["violations"]:
        return {**row, **nan, "status": "refused: " + rep["violations"][0]}
    try:
        attack = None if attack_name == "none" else build_gossip_attack(attack_name, **params)
    except ConfigError as e:
        return {**row, **nan, "status": f"refused: {e}"}
    w = graphs.mixing_matrix(g, str(cfg["weights"]))
    x = torch.randn(g.num_nodes, int(cfg["dim"]), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(int(cfg["seed"])))
    gen = torch.Generator().manual_seed(int(cfg["seed"]) + 1)
    honest = [i for i in range(g.num_nodes) if i not in byz]
    start = consensus_distance(x, honest)
    mean0 = x[honest].mean(dim=0)
    info: dict[str, Any] = {"kappa": {}}
    status = "ok"
    try:
        for _ in range(int(cfg["rounds"])):
            x, info = gossip_round(x, g, w, byz, rule, node_f=node_f, attack=attack, generator=gen)
            if not bool(torch.isfinite(x[honest]).all()) or consensus_distance(x, honest) > DIVERGED:
                status = "diverged"
                break
    except (AssumptionError, ConfigError) as e:
        return {**row, **nan, "status": f"refused: {e}"}
    kap = [v for v in info["kappa"].values() if math.isfinite(v)]
    return {**row, "consensus_start": start, "consensus_end": consensus_distance(x, honest),
            "drift": float(torch.linalg.vector_norm(x[honest].mean(dim=0) - mean0)),
            "kappa_mean": sum(kap) / len(kap) if kap else math.nan, "kappa_max": max(kap) if kap else math.nan,
            "status": status}


def run_grid(cfg: dict[str, Any]) -> pd.DataFrame:
    """Every (topology, rule, attack) of ``cfg`` (keys as in ``conf/gossip_consensus``)."""
    rows = [run_cell(t, r, a, cfg) for t in cfg["topologies"] for r in cfg["rules"] for a in cfg["attacks"]]
    return pd.DataFrame(rows, columns=COLUMNS)


@hydra.main(config_path="../conf/gossip_consensus", config_name="gossip_consensus", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run, print and write ``gossip_consensus.csv`` in the run directory."""
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    table = run_grid(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    with pd.option_context("display.width", 200, "display.max_colwidth", 40):
        print(table.drop(columns=["placement", "node_f", "rounds"]).to_string(index=False))
    path = out_dir / "gossip_consensus.csv"
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w") as fh:
        table.to_csv(fh, index=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
