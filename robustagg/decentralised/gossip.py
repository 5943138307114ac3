"""One mixing round of decentralised learning on stacked node models, and its honest-node metrics.

The state of ``N`` nodes is one ``(N, d)`` tensor ``x`` (row ``i``: the model node ``i`` sends this
round, after its local step). :func:`gossip_round` gives every honest node what its neighbours
sent (a Byzantine neighbour's message computed by the attack against that receiver's view) and
applies the node rule. A Byzantine node also mixes, honestly, what its neighbours really sent: its
row is the model it computes by the protocol (what a data attack leaves it, and what an attack
such as the sign flip starts from); only its messages lie.

    >>> import torch
    >>> from robustagg.decentralised import graph, rules, gossip
    >>> g = graph.complete(3); w = graph.mixing_matrix(g, "uniform")
    >>> x = torch.tensor([[0.0], [3.0], [6.0]], dtype=torch.float64)
    >>> y, info = gossip.gossip_round(x, g, w, (), rules.GossipAverage(), node_f=0)
    >>> y.flatten().tolist(), gossip.consensus_distance(y, [0, 1, 2])
    ([3.0, 3.0, 3.0], 0.0)
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ShapeError
from .graph import Graph
from .rules import NodeRule

__all__ = ["gossip_round", "consensus_distance", "honest_sides"]


def consensus_distance(x: torch.Tensor, honest: Sequence[int]) -> float:
    """The honest consensus distance ``(1 / |H|) sum_{i in H} ||x_i - xbar_H||^2`` (float64), with
    ``xbar_H`` the honest nodes' mean model (He, Karimireddy, Jaggi 2022, Sec. 5). Units: squared
    parameter norm."""
    h = x[list(honest)].to(torch.float64)
    if h.shape[0] == 0:
        return math.nan
    return float(((h - h.mean(dim=0)) ** 2).sum(dim=1).mean())


def honest_sides(graph: Graph, byzantine: Sequence[int]) -> dict[int, int]:
    """``{honest node: 0 or 1}``: the two halves of the honest subgraph by the sign of its Fiedler
    vector (the split attack's targets; ties of a zero entry go to side 0)."""
    bad = set(int(b) for b in byzantine)
    honest = [i for i in range(graph.num_nodes) if i not in bad]
    a = graph.adjacency[np.ix_(honest, honest)].astype(np.float64)
    lap = np.diag(a.sum(axis=1)) - a
    vec = np.linalg.eigh(lap)[1][:, 1] if len(honest) > 1 else np.zeros(len(honest))
    if vec.size and vec[int(np.argmax(np.abs(vec)))] < 0:
        vec = -vec  # a sign convention, so the sides do not depend on the eigensolver's choice
    return {i: (0 if v >= 0 else 1) for i, v in zip(honest, vec)}


def _direction(x: torch.Tensor, sides: dict[int, int], generator: Optional[torch.Generator]) -> torch.Tensor:
    zero = [i for i, s in sides.items() if s == 0]
    one = [i for i, s in sides.items() if s == 1]
    xd = x.to(torch.float64)
    u = (xd[zero].mean(dim=0) - xd[one].mean(dim=0)) if zero and one else torch.zeros(x.shape[1], dtype=torch.float64)
    norm = float(torch.linalg.vector_norm(u))
    if norm == 0.0:
        u = torch.randn(x.shape[1], generator=generator, dtype=torch.float64)
        norm = float(torch.linalg.vector_norm(u))
    return u / norm


def gossip_round(x: torch.Tensor, graph: Graph, w: np.ndarray, byzantine: Sequence[int], rule: NodeRule, *,
                 node_f: int, attack: Any = None, generator: Optional[torch.Generator] = None,
                 sides: Optional[dict[int, int]] = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """One mixing round.

    Args:
        x: ``(N, d)`` floating: the model every node sends this round (a Byzantine node's row is
            the model it computed honestly; the attack decides what it actually sends).
        graph: the communication graph (``N`` nodes).
        w: ``(N, N)`` float64 gossip weights (:func:`~robustagg.decentralised.graph.mixing_matrix`).
        byzantine: the Byzantine node ids.
        rule: the node rule every honest node applies (:mod:`~robustagg.decentralised.rules`).
        node_f: the Byzantine neighbours the rule is declared to tolerate at each node.
        attack: a :class:`attacks.gossip.GossipAttack`, or ``None``: Byzantine nodes send their
            honestly computed row (a data attack then acts through their local step alone).
        generator: the attack's seeded generator.
        sides: the split attack's honest halves (default :func:`honest_sides`, computed here).

    Returns:
        ``(y, info)``: ``y`` ``(N, d)`` in ``x``'s dtype (every row mixed; a Byzantine node's with
        its neighbours' true rows) and ``info`` with ``"kappa"``: ``{honest node: ||y_i - hbar_i||^2 / spread_i}``, the
        empirical robustness coefficient of node ``i``'s step against the mean ``hbar_i`` of its
        honest inputs (its own model and its honest neighbours' messages; ``spread_i`` their mean
        squared distance from ``hbar_i``; ``nan`` where it is 0), the suppression of a rule with
        nobody attacking and its integrity under attack.

    Raises:
        ShapeError: ``x`` is not ``(N, d)`` floating or ``w`` not ``(N, N)``.
    """
    n = graph.num_nodes
    if x.dim() != 2 or x.shape[0] != n or not x.is_floating_point():
        raise ShapeError(f"gossip_round takes the node models as one ({n}, d) floating tensor; got "
                         f"{tuple(x.shape)} {x.dtype}.")
    if tuple(np.shape(w)) != (n, n):
        raise ShapeError(f"gossip weights must be ({n}, {n}); got {np.shape(w)}.")
    bad = set(int(b) for b in byzantine)
    wt = torch.as_tensor(np.asarray(w, dtype=np.float64))
    direction = None
    if attack is not None and bad and getattr(attack, "needs_sides", False):
        sides = honest_sides(graph, sorted(bad)) if sides is None else sides
        direction = _direction(x, sides, generator)
    y = x.clone()
    kappa: dict[int, float] = {}
    for i in range(n):
        nb = list(graph.neighbours(i))
        if i in bad:  # its honest computation (what the attack may start from next round): no lies to it
            y[i] = rule.mix(x[i], x[nb], float(wt[i, i]), wt[i, nb], f=int(node_f))
            continue
        received = x[nb].clone()
        byz = [t for t, j in enumerate(nb) if j in bad]
        hon = [t for t, j in enumerate(nb) if j not in bad]
        if byz and attack is not None:
            msgs = attack(x[i], x[[nb[t] for t in hon]], wt[i, [nb[t] for t in hon]], wt[i, [nb[t] for t in byz]],
                          x[[nb[t] for t in byz]], generator=generator, side=(sides or {}).get(i, 0),
                          direction=direction)
            received[byz] = msgs.to(x.dtype)
        y[i] = rule.mix(x[i], received, float(wt[i, i]), wt[i, nb], f=int(node_f))
        honest_in = torch.cat([x[i][None], x[[nb[t] for t in hon]]]).to(torch.float64)
        centre = honest_in.mean(dim=0)
        spread = float(((honest_in - centre) ** 2).sum(dim=1).mean())
        err = float(((y[i].to(torch.float64) - centre) ** 2).sum())
        kappa[i] = err / spread if spread > 0 else math.nan
    return y, {"kappa": kappa}
