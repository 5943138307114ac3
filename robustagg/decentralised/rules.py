"""Node-side rules: how one node mixes its own model with what its neighbours sent.

Every rule maps node ``i``'s own (half-step) model ``x_i`` ``(d,)``, the ``k`` messages it
received ``m`` ``(k, d)`` (one per neighbour, ascending neighbour id) and its row of the gossip
weights (``w_self = W_ii`` and ``w`` ``(k,)``, float64) to its next model ``(d,)``, in the dtype of
``x_i``. ``f`` is the number of Byzantine neighbours the rule is declared to tolerate at this node
(``protocol.node_f``); the rule's :meth:`NodeRule.requirement` is checked at ``(n, f)`` with
``n = k + 1`` (the node's own model counts as an input) before any process starts
(:func:`robustagg.decentralised.exposure.check_exposure`).

    >>> import torch
    >>> from robustagg.decentralised import rules
    >>> x = torch.tensor([0.0, 0.0]); m = torch.tensor([[1.0, 0.0], [30.0, 40.0]])
    >>> w = torch.tensor([1 / 3, 1 / 3], dtype=torch.float64)
    >>> rules.GossipAverage().mix(x, m, 1 / 3, w, f=0)
    tensor([10.3333, 13.3333])
    >>> rules.SelfCentredClipping(tau=1.0).mix(x, m, 1 / 3, w, f=1)  # (1, 0) kept, (30, 40) clipped to (0.6, 0.8)
    tensor([0.5333, 0.2667])
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional

import torch

from ..errors import ConfigError
from ..requirements import Requirement, linear

__all__ = ["NodeRule", "GossipAverage", "SelfCentredClipping", "ClippedGossip", "BridgeTrimmedMean",
           "BridgeMedian", "NearestNeighbourAveraging", "IOS", "ServerRule", "NODE_RULES", "build_node_rule"]


def _check(own: torch.Tensor, received: torch.Tensor, w: torch.Tensor) -> None:
    if own.dim() != 1 or received.dim() != 2 or received.shape[1] != own.shape[0] or w.shape != (received.shape[0],):
        raise ConfigError(f"a node rule takes own (d,), received (k, d) and weights (k,); got {tuple(own.shape)}, "
                          f"{tuple(received.shape)}, {tuple(w.shape)}.")


def _clip(v: torch.Tensor, tau: float) -> torch.Tensor:
    """Rows of ``v`` ``(k, d)`` scaled to norm at most ``tau`` (float64)."""
    norms = torch.linalg.vector_norm(v, dim=1)
    scale = torch.where(norms > tau, tau / norms.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(norms))
    return v * scale[:, None]


class NodeRule(abc.ABC):
    """Base class of the node-side rules (``protocol.node_rule=<name>``).

    Subclasses implement :meth:`mix`; :meth:`requirement` is ``None`` when the rule has no
    ``(n, f)`` condition (its guarantee is then stated in its docstring in terms of the
    Byzantine neighbours' weight).
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""

    def requirement(self) -> Optional[Requirement]:
        """The inequality between the node's inputs ``n = k + 1`` and its declared ``f``, or ``None``."""
        return None

    def computable(self, k: int, f: int) -> Optional[str]:
        """Why the rule cannot be computed at all at a node with ``k`` neighbours and bound ``f``
        (``None``: it can). Unlike a broken requirement, ``strict=false`` does not run such a node."""
        return None

    @abc.abstractmethod
    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        """The node's next model ``(d,)`` (see the module docstring for the arguments)."""

    def describe(self) -> dict[str, Any]:
        """The rule's name and parameters (for the summary)."""
        return {"node_rule": self.name}


class GossipAverage(NodeRule):
    """Plain gossip averaging ``x_i <- W_ii x_i + sum_j W_ij m_j`` (Boyd et al., IEEE Trans. Inf.
    Theory 2006; decentralised SGD: Lian et al., NeurIPS 2017). No robustness: one Byzantine
    neighbour moves the node anywhere. On the complete graph with uniform weights it is the mean of
    every node's model."""

    name = "gossip"
    paper = "Lian et al., NeurIPS 2017"

    def requirement(self) -> Optional[Requirement]:
        return Requirement("Gossip averaging", "f = 0", lambda n, f: f == 0, self.paper, advisory=True)

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        out = float(w_self) * own.to(torch.float64) + (w[:, None] * received.to(torch.float64)).sum(dim=0)
        return out.to(own.dtype)


class SelfCentredClipping(NodeRule):
    """Self-centred clipping with a fixed radius ``tau`` (He, Karimireddy, Jaggi 2022, "Byzantine-
    robust decentralized learning via ClippedGossip", Eq. (SCClip)):
    ``x_i <- x_i + sum_j W_ij clip(m_j - x_i, tau)``, ``clip(v, tau) = v min(1, tau / ||v||)``.

    Guarantee (their Theorem I): a Byzantine neighbour moves node ``i`` by at most ``W_ij tau``, so
    the damage per round is at most ``delta_i tau`` with ``delta_i`` the Byzantine neighbours' total
    weight; the radius trades that against clipping honest neighbours (suppression). No ``(n, f)``
    condition: the exposure check reports ``delta_i`` and refuses ``delta_i >= 1/2``.

    Raises:
        ConfigError: ``tau`` not a positive finite number.
    """

    name = "self_centred_clipping"
    paper = "He, Karimireddy, Jaggi 2022"

    def __init__(self, tau: float = 1.0) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < float(tau) < float("inf"):
            raise ConfigError(f"protocol.clip_radius must be a positive finite number; got {tau!r}.")
        self.tau = float(tau)

    def radius(self, distances: torch.Tensor, f: int) -> float:
        """The clipping radius at this node (fixed here)."""
        return self.tau

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        x = own.to(torch.float64)
        diff = received.to(torch.float64) - x
        if diff.shape[0] == 0:
            return own.clone()
        tau = self.radius(torch.linalg.vector_norm(diff, dim=1), f)
        return (x + (w[:, None] * _clip(diff, tau)).sum(dim=0)).to(own.dtype)

    def describe(self) -> dict[str, Any]:
        return {"node_rule": self.name, "clip_radius": self.tau}


class ClippedGossip(SelfCentredClipping):
    """ClippedGossip: self-centred clipping with an adaptive radius (He, Karimireddy, Jaggi 2022).

    The radius of their analysis, ``tau_i = sqrt((1 / delta_i) sum_{j honest} W_ij ||x_i - x_j||^2)``,
    needs to know which neighbours are honest, so a node cannot compute it. Here, as in the
    authors' released experiments for one Byzantine neighbour, the radius is an order statistic of
    the distances the node sees: the ``(f + 1)``-th largest ``||m_j - x_i||`` (with ``f`` the node's
    declared bound; at ``f = 1`` the second-largest distance, the authors' choice), so the ``f``
    farthest messages are clipped to the nearest of them and the rest pass unclipped. With
    ``f >= k`` every message is clipped to the smallest distance.

    Guarantee: as :class:`SelfCentredClipping` (``delta_i tau_i`` per round); the adaptive radius
    follows the honest spread, so it clips nothing honest when ``f`` neighbours lie and the rest
    agree.
    """

    name = "clipped_gossip"

    def __init__(self) -> None:
        self.tau = float("nan")

    def radius(self, distances: torch.Tensor, f: int) -> float:
        k = distances.shape[0]
        ordered = torch.sort(distances, descending=True).values
        return float(ordered[min(int(f), k - 1)])

    def describe(self) -> dict[str, Any]:
        return {"node_rule": self.name, "clip_radius": "adaptive: the (f+1)-th largest neighbour distance"}


class BridgeTrimmedMean(NodeRule):
    """BRIDGE-T (Yang and Bajwa, IEEE Trans. Signal Inf. Process. Netw. 2019, Alg. 1 with the
    trimmed-mean screening): per coordinate, drop the ``f`` largest and ``f`` smallest of the ``k``
    received values, then average the remaining ``k - 2f`` with the node's own value (uniform
    weights: the gossip weights are not used).

    Requirement: ``k >= 2f + 1`` neighbours (one received value survives), i.e. ``n >= 2f + 2``
    inputs counting the node itself.
    """

    name = "bridge_trimmed_mean"
    paper = "Yang and Bajwa 2019"

    def requirement(self) -> Optional[Requirement]:
        return linear("BRIDGE-T", 2, 2, self.paper)

    def computable(self, k: int, f: int) -> Optional[str]:
        return None if k - 2 * f >= 1 else f"BRIDGE-T cannot trim f={f} values at each end of k={k} received ones"

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        k = received.shape[0]
        f = int(f)
        if k - 2 * f < 1:
            raise ConfigError(f"BRIDGE-T at a node with {k} neighbours cannot trim f={f} at each end; it needs "
                              f"k >= 2f + 1.")
        s = torch.sort(received.to(torch.float64), dim=0).values[f:k - f]
        return ((s.sum(dim=0) + own.to(torch.float64)) / (k - 2 * f + 1)).to(own.dtype)


class BridgeMedian(NodeRule):
    """BRIDGE-M (Yang and Bajwa 2019): the coordinate-wise median of the node's own value and its
    ``k`` received values (the mean of the two middle values when ``k + 1`` is even).

    Requirement: ``n >= 2f + 1`` inputs (an honest majority at the node).
    """

    name = "bridge_median"
    paper = "Yang and Bajwa 2019"

    def requirement(self) -> Optional[Requirement]:
        return linear("BRIDGE-M", 2, 1, self.paper)

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        x = torch.cat([own[None].to(torch.float64), received.to(torch.float64)])
        s = torch.sort(x, dim=0).values
        m = x.shape[0]
        mid = s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) / 2.0
        return mid.to(own.dtype)


class NearestNeighbourAveraging(NodeRule):
    """Nearest-neighbour averaging, the mixing step of MoNNA (Farhadkhani, Guerraoui, Gupta, Hoang,
    Pinot, Stephan, ICML 2023, Alg. 1): the mean of the ``n - f`` inputs nearest to the node's own
    model (its own model, at distance 0, always among them; ties: the lower neighbour id).

    Requirement: ``n >= 2f + 1`` inputs (their analysis assumes an honest majority).
    """

    name = "nna"
    paper = "Farhadkhani et al., ICML 2023"

    def requirement(self) -> Optional[Requirement]:
        return linear("NNA", 2, 1, self.paper)

    def computable(self, k: int, f: int) -> Optional[str]:
        return None if k >= f else f"NNA cannot drop f={f} of k={k} received models"

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        x = own.to(torch.float64)
        r = received.to(torch.float64)
        keep = r.shape[0] - int(f)
        if keep < 0:
            raise ConfigError(f"NNA at a node with {r.shape[0]} neighbours cannot drop f={f} of them.")
        dist = torch.linalg.vector_norm(r - x, dim=1)
        order = sorted(range(r.shape[0]), key=lambda j: (float(dist[j]), j))[:keep]
        total = x + (r[order].sum(dim=0) if order else torch.zeros_like(x))
        return (total / (keep + 1)).to(own.dtype)


class IOS(NodeRule):
    """Iterative outlier scissor (Wu, Chen, Ling, IEEE Trans. Signal Process. 2023, Alg. 1): ``f``
    times, take the weighted average of the inputs still kept (the node's own model and the kept
    messages, gossip weights renormalised over them) and drop the kept message farthest from it
    (ties: the lower neighbour id); the result is the weighted average of what is left.

    Requirement: ``n >= 2f + 1`` inputs (an honest majority at the node; their analysis bounds the
    Byzantine weight, which the exposure check reports as ``delta_i``).
    """

    name = "ios"
    paper = "Wu, Chen, Ling 2023"

    def requirement(self) -> Optional[Requirement]:
        return linear("IOS", 2, 1, self.paper)

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        x = own.to(torch.float64)
        r = received.to(torch.float64)
        kept = list(range(r.shape[0]))

        def average() -> torch.Tensor:
            ws = w[kept]
            return (float(w_self) * x + (ws[:, None] * r[kept]).sum(dim=0)) / (float(w_self) + float(ws.sum()))

        for _ in range(min(int(f), len(kept))):
            centre = average()
            dist = torch.linalg.vector_norm(r[kept] - centre, dim=1)
            far = max(range(len(kept)), key=lambda t: (float(dist[t]), -kept[t]))
            kept.pop(far)
        return average().to(own.dtype)


class ServerRule(NodeRule):
    """Any server rule of :mod:`robustagg` used as a node rule: the rule aggregates the ``n = k + 1``
    rows ``[x_i; m_1; ...; m_k]`` with the node's declared ``f`` (the gossip weights are not used).
    Its requirement is the rule's own at ``(n, f)``.

    Args:
        rule: a registered name (``"trimmed_mean"``, ``"nnm>krum"``: :func:`robustagg.get`).

    Raises:
        ConfigError: an unknown rule name.
    """

    name = "server"

    def __init__(self, rule: str) -> None:
        from ..registry import get

        self.rule_name = str(rule)
        self._build = lambda f: get(self.rule_name, f=int(f))
        self._cache: dict[int, Any] = {}
        self._build(0)  # an unknown name fails here, at configuration time

    def _rule(self, f: int) -> Any:
        if f not in self._cache:
            self._cache[f] = self._build(f)
        return self._cache[f]

    def requirement(self) -> Optional[Requirement]:
        rule = self._rule(0)
        req = getattr(rule, "requirement", None)
        return req if isinstance(req, Requirement) else None

    def requirements(self, n: int, f: int) -> list[str]:
        """The rule's violations at ``(n, f)`` (a pipeline checks each of its stages)."""
        return list(self._rule(int(f)).violations(int(n)))

    def mix(self, own: torch.Tensor, received: torch.Tensor, w_self: float, w: torch.Tensor, *, f: int) -> torch.Tensor:
        _check(own, received, w)
        rule = self._rule(int(f))
        rule.reset()
        x = torch.cat([own[None], received.to(own.dtype)])
        return rule(x).to(own.dtype)

    def describe(self) -> dict[str, Any]:
        return {"node_rule": f"server:{self.rule_name}"}


#: ``protocol.node_rule`` names; ``server:<rule>`` takes any :func:`robustagg.available` rule.
NODE_RULES = ("gossip", "self_centred_clipping", "clipped_gossip", "bridge_trimmed_mean", "bridge_median", "nna",
              "ios")


def build_node_rule(name: str, *, clip_radius: float = 1.0) -> NodeRule:
    """The node rule ``protocol.node_rule`` names (``server:<rule>`` for a server rule).

    Raises:
        ConfigError: an unknown name (naming the known ones) or a bad parameter.
    """
    if name.startswith("server:"):
        return ServerRule(name.split(":", 1)[1])
    table: dict[str, Any] = {"gossip": GossipAverage, "clipped_gossip": ClippedGossip,
                             "bridge_trimmed_mean": BridgeTrimmedMean, "bridge_median": BridgeMedian,
                             "nna": NearestNeighbourAveraging, "ios": IOS}
    if name == "self_centred_clipping":
        return SelfCentredClipping(clip_radius)
    if name not in table:
        raise ConfigError(f"unknown protocol.node_rule {name!r}; choose one of {', '.join(NODE_RULES)} or "
                          "server:<rule> (any aggregator name).")
    return table[name]()
