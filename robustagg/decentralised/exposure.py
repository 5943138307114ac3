"""Per-node requirements of decentralised learning: which honest node sees how many Byzantine neighbours.

A server rule's requirement is one inequality between ``n`` and ``f``. On a graph every honest
node ``i`` runs the node rule on its own ``n_i = deg(i) + 1`` inputs, of which ``b_i`` come from
Byzantine neighbours; the run is sound only when at every honest node

1. ``b_i <= node_f`` (the rule is told to tolerate at least the Byzantine neighbours it has),
2. the rule's requirement holds at ``(n_i, node_f)`` (e.g. BRIDGE-T: ``n_i >= 2 node_f + 2``),
3. the Byzantine neighbours' gossip weight ``delta_i = sum_{j Byz} W_ij`` stays below 1/2 (at or
   above it the liars outweigh every honest input the node has, itself included: no rule that
   mixes with these weights can tell them apart; He, Karimireddy, Jaggi 2022 bound the damage by
   ``delta_i``),

and the honest nodes must form a connected subgraph (else no rule brings them to one model). The
honest subgraph's spectral gap ``gamma`` (:func:`robustagg.decentralised.graph.spectral_gap`) is
reported: He et al.'s ClippedGossip guarantee needs ``delta_max`` small against ``gamma``.

    >>> from robustagg.decentralised import graph, rules
    >>> from robustagg.decentralised.exposure import exposure
    >>> rep = exposure(graph.ring(6), (0,), rules.ClippedGossip(), node_f=1)
    >>> rep["violations"], [(r["node"], r["byzantine_neighbours"]) for r in rep["nodes"] if r["byzantine_neighbours"]]
    ([], [(1, [0]), (5, [0])])
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from ..errors import AssumptionError, AssumptionWarning, ConfigError
from .graph import Graph, honest_subgraph, mixing_matrix
from .rules import NodeRule, ServerRule

__all__ = ["exposure", "check_exposure"]

#: the Byzantine weight at which a node is over-exposed (see the module docstring, point 3).
MAX_BYZANTINE_WEIGHT = 0.5


def exposure(graph: Graph, byzantine: Sequence[int], rule: NodeRule, *, node_f: int,
             weighting: str = "metropolis") -> dict[str, Any]:
    """Every honest node's exposure and the honest subgraph, with the violations (nothing raised).

    Returns:
        ``{"nodes": [{"node", "degree", "inputs", "byzantine_neighbours", "byzantine_weight"}, ...]``
        (honest nodes, ascending), ``"byzantine_weight_max"``, ``"honest_connected"``,
        ``"honest_components"``, ``"spectral_gap"``, ``"violations": [str, ...]}``.

    Raises:
        ConfigError: ``node_f`` not a non-negative int, or a Byzantine id outside the graph.
    """
    if isinstance(node_f, bool) or not isinstance(node_f, (int, np.integer)) or node_f < 0:
        raise ConfigError(f"protocol.node_f must be a non-negative integer; got {node_f!r}.")
    n = graph.num_nodes
    bad = sorted(set(int(b) for b in byzantine))
    if any(not 0 <= b < n for b in bad):
        raise ConfigError(f"Byzantine nodes {bad} outside the graph {graph.name} of {n} nodes.")
    w = mixing_matrix(graph, weighting)
    nodes: list[dict[str, Any]] = []
    violations: list[str] = []
    broken_at: dict[tuple[int, str], list[str]] = {}  # (degree, the rule's message) -> the nodes, one message
    impossible: dict[tuple[int, str], list[str]] = {}  # (degree, why the rule cannot run) -> the nodes
    req = rule.requirement()
    for i in range(n):
        if i in bad:
            continue
        nb = graph.neighbours(i)
        byz = [j for j in nb if j in bad]
        delta = float(sum(w[i, j] for j in byz))
        inputs = len(nb) + 1
        nodes.append({"node": i, "degree": len(nb), "inputs": inputs, "byzantine_neighbours": byz,
                      "byzantine_weight": delta})
        where = f"honest node {i} (degree {len(nb)}, Byzantine neighbours {byz})"
        if len(byz) > node_f:
            violations.append(f"{where} has {len(byz)} Byzantine neighbours but the node rule tolerates "
                              f"protocol.node_f={node_f}: raise protocol.node_f to {len(byz)}, or place fewer "
                              "Byzantine nodes next to it.")
        if isinstance(rule, ServerRule):
            broken = rule.requirements(inputs, int(node_f))
        else:
            broken = req.check(inputs, int(node_f)) if req is not None and not req.advisory else []
        for msg in broken:
            broken_at.setdefault((len(nb), msg), []).append(f"{i} (Byzantine neighbours {byz})" if byz else str(i))
        why = rule.computable(len(nb), int(node_f))
        if why is not None:
            impossible.setdefault((len(nb), why), []).append(str(i))
        if byz and delta >= MAX_BYZANTINE_WEIGHT:
            violations.append(f"{where}: its Byzantine neighbours hold {delta:.3f} of its gossip weight (>= "
                              f"{MAX_BYZANTINE_WEIGHT}): they outweigh every honest input. Use a denser topology "
                              "or another placement.")
    for (degree, msg), which in broken_at.items():
        violations.append(f"honest node{'s' if len(which) > 1 else ''} {', '.join(which)} (degree {degree}): {msg} "
                          "Use a denser topology or lower protocol.node_f.")
    sub = honest_subgraph(graph, bad, weighting)
    if not sub["connected"]:
        violations.append(f"the honest nodes of {graph.name} are disconnected without the Byzantine nodes {bad} "
                          f"(components {sub['components']}): no rule can bring them to one model. Use a topology "
                          "with more paths (torus, exponential) or another placement.")
    cannot = [f"honest node{'s' if len(which) > 1 else ''} {', '.join(which)} (degree {degree}): {why}, so it cannot "
              "run there even to study breakdown. Use a denser topology or lower protocol.node_f."
              for (degree, why), which in impossible.items()]
    return {"nodes": nodes, "cannot_run": cannot,
            "byzantine_weight_max": max((float(r["byzantine_weight"]) for r in nodes), default=0.0),
            "honest_connected": sub["connected"], "honest_components": sub["components"],
            "spectral_gap": sub["spectral_gap"], "violations": violations}


def check_exposure(graph: Graph, byzantine: Sequence[int], rule: NodeRule, *, node_f: int,
                   weighting: str = "metropolis", strict: bool = True) -> dict[str, Any]:
    """:func:`exposure`, refusing a broken setting: called before any process starts.

    Returns:
        the :func:`exposure` report (its ``violations`` non-empty only when ``strict=False``).

    Raises:
        AssumptionError: ``strict`` and some honest node is over-exposed or the honest subgraph is
            disconnected (every violation named: node, its Byzantine neighbours, the fix); or, strict
            or not, the rule cannot be computed at some node.
        ConfigError: as :func:`exposure`.
    """
    rep = exposure(graph, byzantine, rule, node_f=node_f, weighting=weighting)
    if rep["cannot_run"]:  # not a breakdown to study: refused under strict=false too (a sweep skips it)
        raise AssumptionError(" ".join(rep["cannot_run"]))
    if rep["violations"]:
        text = " ".join(rep["violations"])
        if strict:
            raise AssumptionError(text + " Or pass strict=false to study breakdown.")
        warnings.warn(text, AssumptionWarning, stacklevel=2)
    return rep
