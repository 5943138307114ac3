"""``protocol=gossip``: decentralised learning on a graph, one model per node, no server.

Every worker is a node of a communication graph (:mod:`robustagg.decentralised.graph`) and keeps
its own model ``x_i`` and its own optimizer state. One update (the trainer's step):

1. **local step** (:meth:`Gossip.submit`): node ``i`` computes the gradient of its loss on one
   batch of its shard at ``x_i`` and takes one step of its own optimizer (the ``optimizer`` group,
   one instance per node, state checkpointed with the worker): ``x_i^{+1/2}``;
2. **exchange**: every node's ``x^{+1/2}`` is all-gathered with the trainer's integrity checks
   (a simulation of the neighbour-to-neighbour messages: every process then holds every row);
3. **mixing** (:meth:`Gossip.mix`): every honest node applies the node rule
   (:mod:`robustagg.decentralised.rules`) to its own row and what its neighbours sent, a Byzantine
   neighbour's message computed against that receiver's view by the gossip attack
   (:mod:`attacks.gossip`); every process computes every node's mix (identical inputs, identical
   code), so all node models are replicated state and the run resumes bit-equal.

The trainer's own model holds the honest nodes' average ``xbar_H`` after every update (what the
final checkpoint and ``model.safetensors`` hold); the evaluation (:meth:`Gossip.evaluate_nodes`)
tests every honest node's model: ``test/acc`` is their mean, ``test/acc_worst_node`` the minimum.

Guarantees: the per-node requirement of the node rule at every honest node's degree, the
connectivity of the honest subgraph and its spectral gap are checked before launch
(:func:`robustagg.decentralised.exposure.check_exposure`, strict by default). Gives up: no global
model (the nodes agree only as far as the rule and the graph bring them together: the per-step
``gossip/consensus_distance`` says how far); one model per node costs ``N d`` memory per process.

Relation to dsgd (tested): on the complete graph with uniform weights, gossip averaging with plain
SGD, no momentum, and everyone honest takes node ``i`` to ``(1/N) sum_j (x_j - lr g_j)``; all nodes
start equal, so after every step every node holds exactly dsgd-with-the-mean's model,
``x - lr (1/N) sum_j g_j``, up to float rounding (the two sum in a different order).
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy as np
import torch

from .._tensor import flatten, unflatten_like
from ..errors import ConfigError
from .base import Protocol, RoundPlan, Trainer

__all__ = ["Gossip"]


class Gossip(Protocol):
    """Decentralised SGD on a graph with a node-side robust rule (see the module docstring).

    Args:
        topology: ``ring|torus|complete|erdos_renyi|exponential|dumbbell|edges|file``
            (:func:`robustagg.decentralised.graph.build`).
        node_rule: a :data:`~robustagg.decentralised.rules.NODE_RULES` name or ``server:<rule>``.
        node_f: the Byzantine neighbours the node rule tolerates at every node.
        weights: ``metropolis`` or ``uniform`` gossip weights.
        placement: where the Byzantine workers sit on the graph: ``max_degree`` (default; on a
            regular graph the lowest ids, adjacent on a ring, so its honest path stays connected),
            ``random`` or ``cut`` (:func:`~robustagg.decentralised.graph.place_byzantine`); the
            worker ranks are mapped to
            graph nodes so that the run's Byzantine ranks land there (honest ranks fill the other
            nodes in ascending order).
        clip_radius: ``self_centred_clipping``'s fixed radius.
        edge_probability: ``erdos_renyi``'s edge probability.
        torus_rows: ``torus``'s number of rows (0: the divisor of ``n`` nearest ``sqrt(n)``).
        edges: ``topology="edges"``: the list of ``[i, j]`` edges.
        adjacency_file: ``topology="file"``: the graph's file
            (:func:`~robustagg.decentralised.graph.from_file`).
        graph_seed: seed of the random graph and of the random placement.
        strict: refuse (default) or only warn on an over-exposed honest node or a disconnected
            honest subgraph.
        client_optimizer: ``params -> torch.optim.Optimizer``: each node's own optimizer (the apps
            pass the ``optimizer`` group).

    Raises:
        ConfigError: a bad topology, rule, weighting or placement name or parameter (naming
            ``protocol.<key>``); at :meth:`bind`: worker momentum, a scheduler, model buffers, a
            server gradient attack (use a gossip attack), ``on_nonfinite=drop`` or a missing
            ``client_optimizer``.
        AssumptionError: at :meth:`bind` (strict): an honest node is over-exposed or the honest
            subgraph is disconnected (every such node named, with its Byzantine neighbours).
    """

    name: ClassVar[str] = "gossip"
    gathers: ClassVar[bool] = True
    shrinkable: ClassVar[bool] = False
    mixes: ClassVar[bool] = True

    def __init__(self, *, topology: str = "ring", node_rule: str = "clipped_gossip", node_f: int = 1,
                 weights: str = "metropolis", placement: str = "max_degree", clip_radius: float = 1.0,
                 edge_probability: float = 0.5, torus_rows: int = 0, edges: Any = None, adjacency_file: Any = None,
                 graph_seed: int = 0, strict: bool = True,
                 client_optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None) -> None:
        from ..decentralised import graph as graphs
        from ..decentralised.rules import build_node_rule

        self.topology, self.weighting, self.placement = str(topology), str(weights), str(placement)
        if self.weighting not in graphs.WEIGHTINGS:
            raise ConfigError(f"unknown protocol.weights {weights!r}; choose one of {', '.join(graphs.WEIGHTINGS)}.")
        if self.placement not in graphs.PLACEMENTS:
            raise ConfigError(f"unknown protocol.placement {placement!r}; choose one of "
                              f"{', '.join(graphs.PLACEMENTS)}.")
        f_given: Any = node_f  # the config may hand any number type (numpy ints too)
        if isinstance(f_given, bool) or not isinstance(f_given, numbers.Integral) or int(f_given) < 0:
            raise ConfigError(f"protocol.node_f must be a non-negative integer; got {node_f!r}.")
        self.node_f: int = int(f_given)
        seed_given: Any = graph_seed
        if isinstance(seed_given, bool) or not isinstance(seed_given, numbers.Integral):
            raise ConfigError(f"protocol.graph_seed must be an integer; got {graph_seed!r}.")
        strict_given: Any = strict
        if not isinstance(strict_given, bool):
            raise ConfigError(f"protocol.strict must be true or false; got {strict!r}.")
        self.rule_name = str(node_rule)
        self.rule = build_node_rule(self.rule_name, clip_radius=clip_radius)
        self.graph_args = {"edge_probability": edge_probability, "torus_rows": torus_rows, "edges": edges,
                           "adjacency_file": adjacency_file, "seed": int(graph_seed)}
        if self.topology not in graphs.TOPOLOGIES:
            graphs.build(self.topology, 4)  # raises, naming the known topologies
        self.graph_seed, self.strict = int(graph_seed), bool(strict)
        self.client_optimizer = client_optimizer
        self.graph: Any = None
        self.node_of: dict[int, int] = {}
        self.byzantine: tuple[int, ...] = ()  # ranks
        self.models: Optional[torch.Tensor] = None  # (N, d) in rank order, replicated
        self._opt_state: dict[int, Optional[dict[str, Any]]] = {}
        self._trainer: Any = None
        self.report: dict[str, Any] = {}

    # --- set-up ---------------------------------------------------------------------------
    def layout(self, n: int, byzantine: Sequence[int]) -> tuple[Any, dict[int, int], dict[str, Any]]:
        """The graph on ``n`` nodes, ``{rank: node}`` and the exposure report for the Byzantine
        ``byzantine`` ranks (checked: :func:`~robustagg.decentralised.exposure.check_exposure`).

        Raises:
            ConfigError, AssumptionError: as the class says.
        """
        from ..decentralised import graph as graphs
        from ..decentralised.exposure import check_exposure

        g = graphs.build(self.topology, int(n), **self.graph_args)
        byz = sorted(int(r) for r in byzantine)
        placed = graphs.place_byzantine(g, len(byz), self.placement, seed=self.graph_seed)
        free = [v for v in range(n) if v not in placed]
        honest = [r for r in range(n) if r not in byz]
        node_of = {**dict(zip(byz, placed)), **dict(zip(honest, free))}
        rep = check_exposure(g, placed, self.rule, node_f=self.node_f, weighting=self.weighting, strict=self.strict)
        return g, node_of, rep

    def check(self, *, n: int, rule: Any) -> None:
        """The graph fits ``n`` nodes (the per-node exposure needs the Byzantine ranks: the apps
        check it before launch with :meth:`layout`, and :meth:`bind` checks it again).

        Raises:
            ConfigError: a topology that does not fit ``n``, or a bad topology parameter.
        """
        from ..decentralised import graph as graphs

        graphs.build(self.topology, int(n), **self.graph_args)

    def bind(self, trainer: Trainer) -> None:
        """Build the graph and place the Byzantine workers; every node starts from the trainer's model."""
        if self.client_optimizer is None:
            raise ConfigError("protocol=gossip needs each node's optimizer: pass client_optimizer=(params -> "
                              "optimizer), e.g. functools.partial(torch.optim.SGD, lr=0.1); the apps use the "
                              "optimizer group.")
        if trainer.worker_momentum > 0:
            raise ConfigError("protocol=gossip steps each node's own optimizer; set trainer.worker_momentum=0 and put "
                              "momentum in the optimizer group (optimizer.momentum).")
        if trainer.scheduler is not None:
            raise ConfigError("protocol=gossip has no server optimizer for a scheduler to step; remove the scheduler.")
        if any(b.is_floating_point() for b in trainer.model.buffers()):
            raise ConfigError("protocol=gossip keeps one parameter vector per node; a model with floating buffers "
                              "(BatchNorm running statistics) is not supported yet: use a model without them "
                              "(model=mlp, lenet5).")
        byz = trainer.byzantine
        if byz is not None and byz.gradient_fn is not None:
            raise ConfigError(f"attack {byz.name!r} replaces a server submission; under protocol=gossip a Byzantine node "
                              "sends each neighbour its own message: use a gossip attack (dissensus, split, "
                              "gossip_alie, gossip_ipm, gossip_sign_flip) or a data attack.")
        policy = getattr(trainer.reduction, "on_nonfinite", None)
        if str(getattr(policy, "value", policy)) == "drop":
            raise ConfigError("protocol=gossip mixes every neighbour's model: trainer.on_nonfinite=drop would leave "
                              "a hole in a node's neighbourhood; use on_nonfinite=abort.")
        n = trainer.comm.world_size
        self.byzantine = tuple(byz.ranks) if byz is not None else ()
        self.graph, self.node_of, self.report = self.layout(n, self.byzantine)
        from ..decentralised.graph import mixing_matrix

        self._w = mixing_matrix(self.graph, self.weighting)
        w0 = flatten([p.detach() for p in trainer.params])
        self.models = w0[None].repeat(n, 1)
        self._opt_state = {r: None for r in trainer.comm.local_ranks}
        self._trainer = trainer

    # --- one update -------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """Every node, every update."""
        return RoundPlan(step=step, members=tuple(range(trainer.comm.world_size)), full=True)

    def _load(self, trainer: Trainer, x: torch.Tensor) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(x.to(trainer.params[0].dtype), trainer.params)

    def submit(self, trainer: Trainer, rank: int, plan: RoundPlan) -> tuple[torch.Tensor, float]:
        """Node ``rank``'s local step from its own model: its ``x^{+1/2}`` ``(d,)`` and its batch loss."""
        assert self.models is not None and self.client_optimizer is not None  # bind ran
        self._load(trainer, self.models[rank])
        opt = self.client_optimizer(trainer.params)
        state = self._opt_state.get(rank)
        if state is not None:
            opt.load_state_dict(copy.deepcopy(state))
        g, loss = trainer.worker_gradient(rank, plan.step)
        for p, grad in zip(trainer.params, unflatten_like(g.to(trainer.params[0].dtype), trainer.params)):
            p.grad = grad.clone()
        opt.step()
        self._opt_state[rank] = opt.state_dict()
        for p in trainer.params:
            p.grad = None
        return flatten([p.detach() for p in trainer.params]), loss

    def mix(self, trainer: Trainer, rows: torch.Tensor, plan: RoundPlan, byzantine: tuple[int, ...]) -> dict[str, float]:
        """Every node's mixing step from the all-gathered ``rows`` ``(N, d)`` (rank order); sets the
        trainer's model to the honest nodes' average.

        Returns:
            the step's metrics: ``gossip/consensus_distance`` (the honest nodes' mean squared
            distance from their average model), ``gossip/kappa/<rank>`` for every honest node (its
            mixing step's empirical robustness coefficient against the mean of its honest inputs:
            suppression with nobody attacking, integrity under attack; ``nan`` where its honest
            inputs coincide) and their mean and maximum ``gossip/kappa_mean``, ``gossip/kappa_max``.
        """
        from ..decentralised.gossip import consensus_distance, gossip_round

        n = rows.shape[0]
        perm = [0] * n
        for r, v in self.node_of.items():
            perm[v] = r
        x_nodes = rows[perm]
        byz = trainer.byzantine
        attack = getattr(byz, "gossip_fn", None) if byz is not None and byzantine else None
        gen = trainer.attack_generator
        placed = sorted(self.node_of[r] for r in self.byzantine)
        y, info = gossip_round(x_nodes, self.graph, self._w, placed, self.rule, node_f=self.node_f,
                               attack=attack, generator=gen)
        models = torch.empty_like(rows)
        for r, v in self.node_of.items():
            models[r] = y[v]
        self.models = models
        honest = [r for r in range(n) if r not in self.byzantine]
        self._load(trainer, self.average(honest))
        rank_of = {v: r for r, v in self.node_of.items()}
        per_node = {rank_of[v]: k for v, k in info["kappa"].items()}
        kappa = [v for v in per_node.values() if math.isfinite(v)]
        return {"gossip/consensus_distance": consensus_distance(models, honest),
                "gossip/kappa_mean": sum(kappa) / len(kappa) if kappa else math.nan,
                "gossip/kappa_max": max(kappa) if kappa else math.nan,
                **{f"gossip/kappa/{r}": per_node[r] for r in sorted(per_node)}}

    def average(self, ranks: Sequence[int]) -> torch.Tensor:
        """The mean model of nodes ``ranks`` ``(d,)`` (float64 sum, the models' dtype)."""
        assert self.models is not None
        return self.models[list(ranks)].to(torch.float64).mean(dim=0).to(self.models.dtype)

    def apply(self, trainer: Trainer, aggregate: torch.Tensor, plan: RoundPlan) -> None:
        """Not used: :meth:`mix` is the update (the trainer calls it instead of a reduction)."""
        raise ConfigError("protocol=gossip has no server aggregate to apply.")

    def evaluate_nodes(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``evaluate`` on every honest node's model: ``test/acc`` and ``test/loss`` their means,
        ``test/acc_worst_node`` / ``test/acc_best_node`` the extremes, ``test/acc_average_model`` the
        honest average model's. The trainer's model is the average again afterwards."""
        trainer = self._trainer
        honest = [r for r in range(trainer.comm.world_size) if r not in self.byzantine]
        assert self.models is not None
        per = []
        for r in honest:
            self._load(trainer, self.models[r])
            per.append(evaluate())
        self._load(trainer, self.average(honest))
        avg = evaluate()
        accs = [float(p["test/acc"]) for p in per]
        out = {"test/acc": sum(accs) / len(accs), "test/acc_worst_node": min(accs), "test/acc_best_node": max(accs),
               "test/acc_average_model": float(avg["test/acc"])}
        if all("test/loss" in p for p in per):
            out["test/loss"] = sum(float(p["test/loss"]) for p in per) / len(per)
        return out

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"models": (N, d)}``: every node's model (replicated: every process mixes every node)."""
        return {} if self.models is None else {"models": self.models.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        if state.get("models") is not None:
            self.models = state["models"].clone()

    def worker_state(self, rank: int) -> dict[str, Any]:
        """``{"optimizer": state}``: node ``rank``'s own optimizer state (``{}`` before its first step)."""
        state = self._opt_state.get(rank)
        return {} if state is None else {"optimizer": state}

    def load_worker_state(self, rank: int, state: dict[str, Any]) -> None:
        """Restore :meth:`worker_state` output for hosted node ``rank``."""
        opt = (state or {}).get("optimizer")
        self._opt_state[rank] = None if opt is None else copy.deepcopy(opt)

    def describe(self) -> dict[str, Any]:
        """The protocol's settings and the graph's exposure for the summary."""
        out: dict[str, Any] = {"protocol": self.name, "topology": getattr(self.graph, "name", self.topology),
                               "weights": self.weighting, "placement": self.placement, "node_f": self.node_f,
                               **self.rule.describe()}
        if self.report:
            out.update(spectral_gap=self.report["spectral_gap"],
                       byzantine_weight_max=self.report["byzantine_weight_max"],
                       byzantine_nodes=sorted(self.node_of[r] for r in self.byzantine))
        return out
