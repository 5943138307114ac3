"""From a composed config to library objects: validation before launch, then rule, attack, data, model.

:func:`validate` runs in the launching process and refuses a bad configuration with one clear
message *before any worker process starts*: a misspelt key, an unknown rule or attack (the
available ones are listed), the rule's requirement for this ``n`` and ``f``, more actual Byzantine
workers than the declared ``f`` without ``strict=false``, an attack that cannot run in this
setting, or a partition that leaves a worker without data, or faults and fault-tolerance settings
that cannot work (a fault on a worker or step that does not exist, a checkpoint fault without
checkpoints, ``resume=never`` on a folder that holds checkpoints). It returns a picklable
:class:`Plan` that every worker turns into objects with the ``build_*`` functions
(:meth:`Plan.job` turns it into the library's :class:`~robustagg.launch.Job`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import errno
import functools
import hashlib
import inspect
import ipaddress
import json
import math
import re
import socket
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

import robustagg as ra
from robustagg.aggregators.base import Aggregator
from robustagg.distributed import reduction_modes
from robustagg.errors import AssumptionError, AssumptionWarning, ConfigError, RobustAggError
from robustagg.data import DataBundle
from robustagg.launch import Job, RunSettings, WorkerContext, WorkerParts
from robustagg.preaggregation.base import PreAggregator
from robustagg.training import AttackAdapter, ByzantineBehaviour, Fault, evaluate
from robustagg.training.batched import parse_batched

from .config import FaultConf, Mode, OptimizerLimits, TrainConfig, logged_config, partition_label
from .data import augment_enabled, build_data
from .models import instantiate_model
from .optim import build_optimizer, build_scheduler, moved_keys
from .value_types import check_target_types, check_tree_types

__all__ = ["Plan", "ExperimentBuild", "as_config", "validate", "build_rule", "build_attack", "build_byzantine",
           "build_model_and_optimizer", "AttackAdapter", "rule_names"]


def rule_names() -> list[str]:
    """Registered names of the final rules (pre-aggregation maps excluded)."""
    return [n for n in ra.available() if issubclass(ra.lookup(n), Aggregator) and n != "pipeline"]


def _attack_names() -> list[str]:
    import attacks

    return list(attacks.available())


def _close(word: str, options: list[str]) -> list[str]:
    """The options nearest to a misspelt ``word`` (difflib ratio >= 0.6), best first."""
    return difflib.get_close_matches(word, options, n=3, cutoff=0.6)


def _unknown_key(path: str, options: list[str], where: str) -> ConfigError:
    key = path.rsplit(".", 1)[-1]
    near = _close(key, options)
    prefix = path[: len(path) - len(key)]
    hint = f" Did you mean {' or '.join(prefix + k for k in near)}?" if near else ""
    return ConfigError(f"unknown key {path}: the schema of {where} does not declare it (a misspelt key, or a '+' "
                       f"override or config file that adds a key no code reads).{hint} The valid keys: "
                       f"{', '.join(options)}.")


def _check_keys(node: Any, schema: Any, path: str) -> None:
    """Refuse every key of the plain container ``node`` that the typed ``schema`` node does not declare.

    Closed: every dataclass node of :mod:`experiments.config` (``threat``, ``data``, ``model``,
    ``trainer``, ``trainer.checkpoint``, ``logger``, each ``faults.<name>`` against ``FaultConf``).
    Open on purpose: ``aggregator``, ``preaggregation`` and ``attack`` (their parameters are checked
    against the class's signature by :func:`_resolve_target`), the entries of ``trainer.callbacks``
    (a callback takes what its class takes), and the names under ``faults`` (one per selected file).
    """
    if not isinstance(node, dict) or not isinstance(schema, DictConfig):
        return
    kind = OmegaConf.get_type(schema)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return
    where = f"{path[:-1] or 'the top level'} ({kind.__name__})"
    options = [str(k) for k in schema.keys()]
    for key, value in node.items():
        if key not in options:
            raise _unknown_key(f"{path}{key}", options, where)
        if key == "faults" and kind is TrainConfig and isinstance(value, dict):
            fault = OmegaConf.structured(FaultConf)
            for name, entry in value.items():
                _check_keys(entry, fault, f"{path}faults.{name}.")
        elif not OmegaConf.is_missing(schema, key):  # a missing node (aggregator) is an open one
            _check_keys(value, schema[key], f"{path}{key}.")


def _early_checks(cfg: DictConfig) -> None:
    """Values read before :func:`validate` runs (``train`` sets the thread count first): seed, threads."""
    seed = cfg.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be an integer in [0, 2**63) (a signed 64-bit value: NumPy's generators refuse "
                          f"negative seeds, torch's refuse 2**64 and above); got {seed!r}. Use e.g. seed=0.")
    from robustagg.limits import limit_of

    threads = limit_of(RunSettings, "threads")
    assert threads is not None
    problem = threads.problem(SETTING_KEYS["threads"], cfg.trainer.threads)
    if problem:
        raise ConfigError(problem)


def as_config(cfg: Any) -> DictConfig:
    """Merge ``cfg`` (a DictConfig or dict) into the typed schema, so misspelt and unknown keys fail here.

    The keys are compared with the schema on a plain copy of ``cfg``: a DictConfig that Hydra
    composed is already typed, and a ``+key=value`` override adds its key with the struct flag
    lifted, which a merge of one typed config into another would keep silently. Open nodes are
    listed in :func:`_check_keys`. The seed and ``trainer.threads`` are checked here too: they are
    used before :func:`validate` runs.

    Raises:
        ConfigError: unknown key (the message names the nearest valid keys), wrong type, a missing
            required value, a seed outside ``[0, 2**63)``, or ``trainer.threads < 1``.
    """
    try:
        raw = (OmegaConf.to_container(cfg, resolve=False, enum_to_str=True) if isinstance(cfg, DictConfig)
               else OmegaConf.to_container(OmegaConf.create(cfg), resolve=False, enum_to_str=True))
        base = OmegaConf.structured(TrainConfig)
        _check_keys(raw, base, "")
        check_tree_types(raw, TrainConfig)  # threat.n="six": one line with the type, before OmegaConf's merge
        merged = OmegaConf.merge(base, OmegaConf.create(raw))
        OmegaConf.resolve(merged)
        for name in list(merged.faults):
            node = merged.faults[name]
            if not isinstance(node, DictConfig):
                raise ConfigError(f"faults.{name} must be a mapping with a kind (see conf/faults/); got {node!r}.")
            merged.faults[name] = OmegaConf.merge(OmegaConf.structured(FaultConf), node)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {exc}".replace("\n", " ").strip()) from None
    _early_checks(merged)  # type: ignore[arg-type]
    return merged  # type: ignore[return-value]


def _resolve_target(node: Any, *, what: str, base: type | tuple[type, ...], names: list[str],
                    prefix: str) -> tuple[type, dict[str, Any]]:
    params = dict(node)
    target = params.pop("_target_", None)
    params.pop("_partial_", None)
    params.pop("_convert_", None)
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{what} needs a _target_ (the class to build); available: {', '.join(names)}.")
    from hydra.utils import get_class

    try:
        cls = get_class(target)
    except Exception:
        cls = None
    if cls is None or not (inspect.isclass(cls) and issubclass(cls, base)):
        raise ConfigError(f"unknown {what} {target!r}; available: {', '.join(names)} (choose with {prefix}=NAME).")
    sig = inspect.signature(cls)
    takes = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
    unknown = [k for k in params if k not in takes]
    if unknown:
        raise ConfigError(f"{what} {cls.__name__} does not take {', '.join(repr(k) for k in unknown)}; "
                          f"its parameters are {', '.join(takes) or '(none)'}.")
    return cls, params


def build_rule(cfg: DictConfig) -> Aggregator:
    """The configured rule, composed with the pre-aggregation map if any (a Pipeline).

    Bucketing's permutation generator is seeded from ``cfg.seed`` (the same on every rank).

    Raises:
        ConfigError: unknown class or parameter, or a bad value.
    """
    names = rule_names()
    cls, params = _resolve_target(cfg.aggregator, what="aggregator", base=Aggregator, names=names, prefix="aggregator")
    try:
        rule = cls(**params)
    except TypeError as exc:
        raise ConfigError(f"aggregator {cls.__name__}: {exc}") from None
    pre_node = cfg.get("preaggregation")
    if pre_node is not None and pre_node.get("_target_") is not None:
        maps = [n for n in ra.available() if issubclass(ra.lookup(n), PreAggregator)]
        pcls, pparams = _resolve_target(pre_node, what="preaggregation", base=PreAggregator, names=maps + ["none"],
                                        prefix="preaggregation")
        pre = pcls(**pparams)
        gen = getattr(pre, "generator", None)
        if isinstance(gen, torch.Generator):
            gen.manual_seed(int(cfg.seed))
        rule = ra.Pipeline(pre=[pre], rule=rule)
    return rule


def build_attack(cfg: DictConfig) -> Any:
    """The configured attack object, or ``None`` for ``attack=none``.

    Raises:
        ConfigError: unknown class or parameter.
    """
    node = cfg.get("attack")
    if node is None or node.get("_target_") is None:
        return None
    import attacks
    from attacks.gossip import GOSSIP_ATTACKS, GossipAttack

    cls, params = _resolve_target(node, what="attack", base=(attacks.Attack, GossipAttack),  # type: ignore[arg-type]
                                  names=["none"] + sorted(_attack_names() + list(GOSSIP_ATTACKS)), prefix="attack")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"attack {cls.__name__}: {exc}") from None


#: The configuration key of every :class:`~robustagg.launch.RunSettings` attribute (for its messages).
SETTING_KEYS: dict[str, str] = {
    **{a: f"trainer.{a}" for a in ("mode", "steps", "batch_size", "worker_momentum", "eval_every", "param_check_every",
                                   "reduction", "on_nonfinite", "metrics", "progress", "device", "backend", "threads",
                                   "start_method", "collective_timeout_s", "master_addr", "port", "resume",
                                   "resume_changes", "max_restarts", "on_failure", "shrink_shards", "straggler_factor",
                                   "processes", "measure_bias", "precision", "rejoin", "peer_copy",
                                   "membership", "batched_gradients", "aggregator_replicas", "lying_aggregators",
                                   "on_aggregate_mismatch", "on_lying_aggregator", "state_sharding",
                                   "shard_redundancy", "shard_parity")},
    "seed": "seed", "checkpoint_every": "trainer.checkpoint.every", "checkpoint_keep": "trainer.checkpoint.keep",
    "ckpt_dir": "trainer.checkpoint.dir", "logger": "logger",
}


#: The ``_target_`` nodes whose parameters :func:`validate` checks against their class's signature
#: (:func:`experiments.value_types.check_target_types`).
TARGET_NODES = ("aggregator", "preaggregation", "attack", "model", "optimizer", "scheduler", "protocol")


@dataclass
class Plan:
    """A validated run, picklable, handed to every worker process.

    Attributes:
        cfg: the resolved configuration as plain containers.
        n, f: workers and declared bound. byzantine_ranks: ranks that attack (empty with no attack).
        rule_name, attack_name, attack_kind: for logs and the summary.
        violations: requirement violations accepted under ``strict=false``, and advisory ones
            (the mean declared with ``f >= 1`` runs as the baseline).
        assumption_violated: the run breaks a (non-advisory) requirement or fields more Byzantine
            workers than ``f``, on purpose (``strict=false``).
        data: the partitioned data set. device, backend: where and how processes talk.
        out_dir: the run directory.
        run_id: a random id of the run (kept across restarts). identities: the worker id (rank in
            the original group) of every rank; ``range(n)`` until an elastic shrink.
        faults: the injected faults. ckpt_dir: the checkpoint folder (resolved).
        fingerprint: the experiment's identity (every key that changes the trajectory; see
            :mod:`robustagg.launch.identity`), compared with a checkpoint's before a resume.
        code_revision: the git commit of the code (or the package version).
        notes: launch notes (logged as warnings).
        batched_gradients: how ``trainer.batched_gradients`` was resolved, e.g. ``"on (auto: dsgd,
            MLP without BatchNorm/dropout)"`` (:meth:`BatchedDecision.describe
            <robustagg.training.batched.BatchedDecision.describe>`); :attr:`cfg` holds the resolved
            ``true``/``false``. Logged at launch and recorded in the summary.
    """

    cfg: dict[str, Any]
    n: int
    f: int
    byzantine_ranks: tuple[int, ...]
    rule_name: str
    attack_name: str
    attack_kind: Optional[str]
    data: DataBundle
    device: str
    backend: str
    out_dir: str
    violations: list[str] = field(default_factory=list)
    assumption_violated: bool = False
    run_id: str = ""
    identities: tuple[int, ...] = ()
    faults: list[Fault] = field(default_factory=list)
    ckpt_dir: str = ""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    code_revision: str = ""
    notes: list[str] = field(default_factory=list)
    batched_gradients: str = ""

    def config(self) -> DictConfig:
        """:attr:`cfg` as a DictConfig."""
        return OmegaConf.create(self.cfg)  # type: ignore[return-value]

    def _identity(self) -> tuple[str, str]:
        return partition_label(self.cfg.get("data") or {}), str(self.cfg.get("seed", 0))

    def run_label(self) -> str:
        """The run's display name (W&B), ``<rule>-<attack>-<partition>-seed<s>``, e.g.
        ``trimmed_mean-alie-dirichlet(a=0.1)-seed3``: the runs of a sweep are told apart."""
        part, seed = self._identity()
        return f"{self.rule_name}-{self.attack_name}-{part}-seed{seed}"

    def logger(self) -> dict[str, Any]:
        """The ``logger`` node with W&B tags ``rule:<rule>``, ``attack:<attack>``,
        ``partition:<label>``, ``seed:<s>`` after the user's own, and the group: ``logger.group``,
        else in a Hydra ``-m`` sweep the sweep folder's last two parts (the report's group,
        :func:`experiments.report_wandb.sweep_group`), else none."""
        node = dict(self.cfg["logger"])
        part, seed = self._identity()
        mine = [f"rule:{self.rule_name}", f"attack:{self.attack_name}", f"partition:{part}", f"seed:{seed}"]
        own = [str(t) for t in node.get("tags") or []]
        node["tags"] = own + [t[:64] for t in mine if t[:64] not in own]  # W&B refuses tags over 64 characters
        if not node.get("group"):
            node["group"] = _sweep_group()
        return node

    def job(self) -> Job:
        """The library :class:`~robustagg.launch.Job` of this plan (what :func:`robustagg.launch.launch` runs)."""
        cfg = self.config()
        tr = cfg.trainer
        settings = RunSettings(
            mode=str(tr.mode), steps=int(tr.steps), batch_size=int(tr.batch_size), seed=int(cfg.seed),
            worker_momentum=float(tr.worker_momentum), eval_every=int(tr.eval_every),
            param_check_every=int(tr.param_check_every), reduction=str(tr.reduction), on_nonfinite=str(tr.on_nonfinite),
            metrics=bool(tr.metrics), progress=bool(tr.progress), device=self.device, backend=self.backend,
            threads=int(tr.threads), start_method=str(tr.start_method), collective_timeout_s=float(tr.collective_timeout_s),
            master_addr=str(tr.master_addr), port=int(tr.port), checkpoint_every=int(tr.checkpoint.every),
            checkpoint_keep=int(tr.checkpoint.keep), ckpt_dir=self.ckpt_dir, resume=str(tr.resume),
            resume_changes=str(tr.resume_changes), max_restarts=int(tr.max_restarts), on_failure=str(tr.on_failure),
            shrink_shards=str(tr.shrink_shards), straggler_factor=float(tr.straggler_factor),
            processes=int(tr.processes), measure_bias=bool(tr.measure_bias), precision=str(tr.precision),
            batched_gradients=parse_batched(tr.batched_gradients), rejoin=bool(tr.rejoin), peer_copy=bool(tr.peer_copy),
            membership=OmegaConf.to_container(tr.membership, resolve=True) if tr.membership else [],
            aggregator_replicas=int(tr.aggregator_replicas), lying_aggregators=int(tr.lying_aggregators),
            on_aggregate_mismatch=str(tr.on_aggregate_mismatch), on_lying_aggregator=str(tr.on_lying_aggregator),
            state_sharding=str(tr.state_sharding), shard_redundancy=int(tr.shard_redundancy),
            shard_parity=int(tr.shard_parity), logger=self.logger(), key_names=SETTING_KEYS)
        meta = {"rule": self.rule_name, "attack": self.attack_name, "data": self.data.name,
                "partition": self.data.partition, "worker_sizes": self.data.sizes(),
                "label_skew": self.data.label_skew(), "code_revision": self.code_revision}
        if self.batched_gradients:
            meta["batched_gradients_reason"] = self.batched_gradients
        return Job(build=ExperimentBuild(cfg=self.cfg, data=self.data, attack_kind=self.attack_kind,
                                         attack_name=self.attack_name),
                   n=self.n, run_dir=self.out_dir, settings=settings, f=self.f, rule=_server_rule(cfg),
                   byzantine_ids=self.byzantine_ranks, identities=self.identities, fingerprint=dict(self.fingerprint),
                   faults=list(self.faults), name=self.run_label(), meta=meta, config=logged_config(self.cfg),
                   run_id=self.run_id, violations=list(self.violations), assumption_violated=self.assumption_violated,
                   data_sizes={w: int(len(p)) for w, p in enumerate(self.data.parts)})


def _sweep_group() -> Optional[str]:
    """``<a>/<b>``, the last two parts of the Hydra sweep folder, in a ``-m`` job; else ``None``."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return "/".join(Path(str(HydraConfig.get().sweep.dir)).parts[-2:])
    except Exception:  # pragma: no cover - Hydra internals
        pass
    return None


@dataclass
class ExperimentBuild:
    """``Job.build`` of a Hydra experiment: the model, optimizer, rule, attack and data of one process.

    Picklable (plain containers and the data bundle), so spawned workers rebuild everything
    identically from it.
    """

    cfg: dict[str, Any]
    data: DataBundle
    attack_kind: Optional[str]
    attack_name: str

    def __call__(self, ctx: WorkerContext) -> WorkerParts:
        from hydra.utils import instantiate

        cfg: DictConfig = OmegaConf.create(self.cfg)  # type: ignore[assignment]
        device = ctx.device
        model, optimizer, scheduler = build_model_and_optimizer(self.data, cfg, device)
        rule = _server_rule(cfg) or ra.Mean()  # protocol=gossip: the reduction only exchanges the rows
        byzantine = build_byzantine(ctx.byzantine_ranks, cfg, rule, attack_kind=self.attack_kind,
                                    attack_name=self.attack_name)
        shards = {}
        for r in ctx.local_ranks:
            s = ctx.shard(r, self.data.shard)
            s.x, s.y = s.x.to(device), s.y.to(device)
            shards[r] = s
        test_x, test_y = self.data.test_x.to(device), self.data.test_y.to(device)
        num_classes = self.data.num_classes
        attack = getattr(byzantine.gradient_fn, "attack", None) if byzantine is not None else None
        backdoor = {"trigger": attack.stamp, "target": attack.target} if hasattr(attack, "stamp") else {}

        def eval_fn() -> dict[str, float]:  # test/asr too under a backdoor
            return evaluate(model, test_x, test_y, num_classes, **backdoor)

        k = int(cfg.server.root_samples)
        root = self.data.root(k, int(cfg.seed)).to(device) if k > 0 else None
        protocol = build_protocol(cfg)
        if hasattr(protocol, "server_optimizer_for"):  # protocol=local: the optimizer group is the clients'
            optimizer = protocol.server_optimizer_for(model.parameters())
            scheduler = build_scheduler(cfg.get("scheduler"), optimizer)
        if hasattr(protocol, "evaluate_nodes"):  # protocol=gossip: every honest node's model is tested
            eval_fn = functools.partial(protocol.evaluate_nodes, eval_fn)
        return WorkerParts(model=model, optimizer=optimizer, rule=rule, shards=shards, scheduler=scheduler,
                           byzantine=byzantine, evaluate=eval_fn, num_classes=num_classes,
                           callbacks=[instantiate(c) for c in cfg.trainer.callbacks], root=root,
                           protocol=protocol)


def _server_rule(cfg: DictConfig) -> Optional[Aggregator]:
    """The server rule a job runs: the configured one, or none under a protocol without a server
    aggregate (``protocol=gossip``: the aggregator group is not used, so its requirement is not the
    run's; the reduction only exchanges the rows, with the mean as its unused rule)."""
    if bool(getattr(build_protocol(cfg), "mixes", False)):
        return None
    return build_rule(cfg)


@dataclass
class GossipPlan:
    """What :func:`_gossip_checks` found (empty when the protocol is not gossip).

    Attributes:
        label: the run's rule label, ``gossip:<node rule>`` (the aggregator group is not used).
        notes: the launch note (the graph, where the Byzantine nodes sit, the largest Byzantine
            weight and the honest spectral gap).
        violations: the per-node violations ``strict=false`` lets run (the run's broken assumptions).
        identity: ``{"protocol.graph_sha256": ...}``: the graph's edges belong to the experiment's
            identity (a resume onto another graph, e.g. an edited adjacency file, is refused).
    """

    label: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    identity: dict[str, str] = field(default_factory=dict)


def _gossip_checks(cfg: DictConfig, n: int, ranks: tuple[int, ...], kind: Optional[str], attack_name: str,
                   attack: Any = None) -> GossipPlan:
    """Under ``protocol=gossip``, before launch: the attack has a gossip form, the trainer settings a
    node-local optimizer allows, and every honest node's exposure with the Byzantine ranks placed on
    the graph (:meth:`robustagg.protocols.Gossip.layout`); a gossip attack needs ``protocol=gossip``.

    Returns:
        a :class:`GossipPlan` (empty when the protocol is not gossip).

    Raises:
        ConfigError: a server gradient attack or a backdoor under gossip, a gossip attack under
            another protocol, a membership schedule, a node the rule or the attack cannot be
            computed at, or a trainer setting gossip has no use for (each naming its key).
        AssumptionError: an over-exposed honest node or a disconnected honest subgraph (strict).
    """
    proto = build_protocol(cfg)
    mixes = bool(getattr(proto, "mixes", False))
    if kind == "gossip" and not mixes:
        raise ConfigError(f"attack={attack_name} is a gossip attack (each neighbour gets its own message): it needs "
                          "protocol=gossip; under a server protocol use alie, ipm or sign_flip.")
    if not mixes:
        return GossipPlan()
    if kind == "data" and hasattr(attack, "poison_batch"):
        raise ConfigError(f"attack={attack_name} poisons batches and goes through the server's gradient hook (a "
                          "backdoor); under protocol=gossip only label poisoning runs as a data attack: use "
                          "attack=label_flip or a gossip attack.")
    if kind == "gradient":
        from attacks.gossip import GOSSIP_ATTACKS

        raise ConfigError(f"attack={attack_name} replaces a server submission; under protocol=gossip a Byzantine node "
                          f"sends each neighbour its own message: use attack={'|'.join(GOSSIP_ATTACKS)} or a data "
                          "attack (label_flip).")
    tr = cfg.trainer
    if float(tr.worker_momentum) > 0:
        raise ConfigError("protocol=gossip steps each node's own optimizer; set trainer.worker_momentum=0 and put "
                          "momentum in the optimizer group (optimizer.momentum).")
    if (cfg.get("scheduler") or {}).get("_target_") is not None:
        raise ConfigError("protocol=gossip has no server optimizer for a scheduler to step; use scheduler=none.")
    if int(tr.aggregator_replicas) > 1:
        raise ConfigError("protocol=gossip has no server aggregate to cross-check: set trainer.aggregator_replicas=1 "
                          "(every node's mix is computed by every process from the same rows).")
    if bool(tr.measure_bias):
        raise ConfigError("protocol=gossip has no synchronous server aggregate to measure a bias against: set "
                          "trainer.measure_bias=false (gossip/consensus_distance and gossip/kappa/<rank> are its "
                          "per-step numbers).")
    if int(cfg.server.root_samples) > 0:
        raise ConfigError("protocol=gossip has no server to hold a root data set: set server.root_samples=0.")
    if str(getattr(tr.on_nonfinite, "value", tr.on_nonfinite)) == "drop":
        raise ConfigError("protocol=gossip mixes every neighbour's model: trainer.on_nonfinite=drop would leave a "
                          "hole in a node's neighbourhood; use trainer.on_nonfinite=abort.")
    if tr.membership:
        raise ConfigError("protocol=gossip keeps one model per node on a fixed graph; trainer.membership (workers "
                          "absent for some steps) cannot run with it. Remove trainer.membership.")
    graph, node_of, rep = proto.layout(n, ranks)
    placed = sorted(node_of[r] for r in ranks)
    if attack is not None and hasattr(attack, "check_view"):
        for node in rep["nodes"]:
            attack.check_view(int(node["inputs"]), len(node["byzantine_neighbours"]))
    note = (f"protocol=gossip on {graph.name}: Byzantine nodes {placed} (worker ranks {list(ranks)}), node rule "
            f"{proto.rule_name} with node_f={proto.node_f}; largest Byzantine gossip weight at an honest node "
            f"{rep['byzantine_weight_max']:.3f}, honest subgraph's spectral gap {rep['spectral_gap']:.3f}.")
    edges = hashlib.sha256(json.dumps(graph.edges()).encode()).hexdigest()
    return GossipPlan(label=f"gossip:{proto.rule.describe()['node_rule']}", notes=[note],
                      violations=list(rep["violations"]), identity={"protocol.graph_sha256": edges})


def build_protocol(cfg: DictConfig) -> Any:
    """The ``protocol`` node as a :class:`~robustagg.protocols.Protocol` (``None``: the default, dsgd).

    Raises:
        ConfigError: the node does not name a Protocol or its arguments are refused.
    """
    from hydra.utils import instantiate

    from robustagg.protocols import Protocol

    node = cfg.get("protocol")
    if node is None or node.get("_target_") in (None, "robustagg.protocols.DSGD"):
        return None
    try:
        proto = instantiate(node, _convert_="all")
    except Exception as exc:  # Hydra wraps the constructor's error
        cause = exc.__cause__ or exc
        raise ConfigError(f"protocol {node.get('_target_')}: {cause}") from None
    if not isinstance(proto, Protocol):
        raise ConfigError(f"protocol._target_={node.get('_target_')} is not a robustagg.protocols.Protocol.")
    if hasattr(proto, "client_optimizer") and proto.client_optimizer is None:  # protocol=local
        opt = OmegaConf.to_container(cfg.optimizer, resolve=True) if isinstance(cfg.get("optimizer"), DictConfig) \
            else cfg.get("optimizer")
        proto.client_optimizer = functools.partial(build_optimizer, opt)  # the optimizer group: local steps
    return proto


def _protocol_checks(cfg: DictConfig, rule: Aggregator, n: int) -> list[str]:
    """The protocol's own settings and the rule's requirement at the rows it gets per update, before launch.

    A protocol that has ``rows_per_update(n)`` (``protocol=local``: ``k`` sampled clients) has the
    rule's requirement checked at that many rows with the rule's ``f``; ``strict=false`` returns the
    violations (recorded) instead of raising.

    Raises:
        ConfigError: a protocol setting out of range or one this run cannot use (names the key).
        AssumptionError: the rule's requirement fails at the rows per update (strict).
    """
    proto = build_protocol(cfg)
    if proto is not None:
        proto.check(n=n, rule=rule)  # its values (protocol.<key>) and its fit to n and the rule
        pf = (cfg.get("protocol") or {}).get("f")
        if pf is not None and int(pf) != int(cfg.threat.f):
            raise ConfigError(f"protocol.f={pf} differs from threat.f={cfg.threat.f}; the protocol's f is the run's "
                              f"declared Byzantine bound. Set threat.f={pf} instead (protocol.f follows it).")
        if bool(cfg.trainer.measure_bias) and getattr(cfg.trainer.mode, "value", cfg.trainer.mode) == "processes":
            raise ConfigError(f"trainer.measure_bias=true needs trainer.mode=simulated under protocol={proto.name}: "
                              "its reference evaluates every worker's submission in one process. Use "
                              "trainer.mode=simulated (bit-identical to processes) or trainer.measure_bias=false.")
        if not getattr(proto, "shrinkable", True) and str(cfg.trainer.on_failure) == "shrink":
            raise ConfigError(f"protocol={proto.name} keeps its state over a fixed n; trainer.on_failure=shrink "
                              "cannot run with it. Use trainer.on_failure=restart.")
    if proto is not None and proto.gathers and str(cfg.trainer.reduction) == "sharded":
        raise ConfigError(f"protocol={proto.name} needs every member's full row on every rank; use "
                          "trainer.reduction=gather (or auto).")
    if proto is None or not hasattr(proto, "rows_per_update"):
        return []
    if float(cfg.trainer.worker_momentum) > 0:
        raise ConfigError(f"trainer.worker_momentum={cfg.trainer.worker_momentum} has no meaning under "
                          f"protocol={proto.name} (clients submit model deltas); set trainer.worker_momentum=0 and "
                          "give the local optimizer momentum (optimizer.momentum=0.9) or the server one "
                          "(protocol.server_optimizer.momentum).")
    rows = int(proto.rows_per_update(n))
    if hasattr(proto, "server_optimizer_for"):
        proto.server_optimizer_for([torch.nn.Parameter(torch.zeros(1))])
    if rows == n:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)
        try:
            found = rule.check(rows)
        except AssumptionError as exc:
            raise AssumptionError(f"protocol={proto.name} gives the rule {rows} rows per update "
                                  f"(protocol.clients_per_round): {exc} Lower aggregator.f (the per-round bound), raise "
                                  "protocol.clients_per_round, or pass strict=false.") from None
    return [f"protocol={proto.name}, {rows} rows per update: {v}" for v in found]


def _redundancy(cfg: DictConfig, n: int, f: int) -> Optional[tuple[int, int, int]]:
    """Under ``protocol=redundant``: ``(r, groups, floor(f / quorum))``, and the rule's derived ``f``.

    The protocol node is built here (its errors name ``protocol.<key>``). Where ``aggregator.f``
    (and ``preaggregation.f``) equals ``threat.f`` (the default interpolation, already resolved), it
    is set to the number of groups ``f`` adversarially placed workers can take over; any other value
    is kept (and checked by :func:`_redundancy_cover`).

    Raises:
        ConfigError: a bad ``protocol.r`` (odd, divides ``threat.n``) or other protocol key, or
            ``trainer.reduction=sharded``.
    """
    node = cfg.get("protocol")
    if node is None or not str(node.get("_target_", "")).endswith("Redundant"):
        return None
    from robustagg.protocols.redundant import groups_of, takeover_bound

    build_protocol(cfg)
    r = node.get("r", 3)
    groups = len(groups_of(n, r if isinstance(r, int) else -1))
    if str(cfg.trainer.reduction) == "sharded":
        raise ConfigError("protocol=redundant votes on every replica's full row on every rank; use "
                          "trainer.reduction=gather (or auto).")
    bad = takeover_bound(f, int(r))
    for key in ("aggregator", "preaggregation"):
        sub = cfg.get(key)
        if sub is not None and "f" in sub and sub.get("f") == f:  # the default ${threat.f} (resolved by now)
            with open_dict(sub):
                sub.f = bad
    return int(r), groups, bad


def _redundancy_note(red: tuple[int, int, int], n: int, f: int) -> str:
    r, groups, bad = red
    q = (r + 2) // 2
    return (f" (protocol=redundant: n={n} workers in {groups} groups of r={r}, quorum {q}; f={f} Byzantine workers "
            f"placed adversarially take over at most floor({f}/{q}) = {bad} groups, so the rule sees {groups} rows "
            f"of which up to {bad} bad.)")


def _redundancy_cover(rule: Aggregator, red: tuple[int, int, int], n: int, f: int, *, strict: bool) -> list[str]:
    """The rule's ``f`` must cover the groups an adversary can take over (an explicit ``aggregator.f``)."""
    if int(getattr(rule, "f", 0)) >= red[2]:
        return []
    msg = (f"aggregator.f={getattr(rule, 'f', 0)} is below the {red[2]} replica groups that threat.f={f} Byzantine "
           f"workers can take over{_redundancy_note(red, n, f)}")
    if strict:
        raise AssumptionError(msg + f" Set aggregator.f={red[2]} (or leave it to ${{threat.f}}, which is derived), "
                              "raise protocol.r, or pass strict=false to study breakdown.")
    return [msg]


def _threat(cfg: DictConfig) -> tuple[int, int, int, tuple[int, ...], list[str]]:
    t = cfg.threat
    n, f, b = int(t.n), int(t.f), int(t.byzantine)
    notes: list[str] = []
    if n < 1:
        raise ConfigError(f"threat.n must be >= 1 worker; got {n}.")
    if f < 0 or b < 0:
        raise ConfigError(f"threat.f and threat.byzantine must be >= 0; got f={f}, byzantine={b}.")
    if b >= n:
        raise ConfigError(f"threat.byzantine={b} leaves no honest worker among n={n}; lower it below n.")
    ranks = tuple(range(n - b, n)) if t.ranks is None else tuple(int(r) for r in t.ranks)
    if len(ranks) != b or len(set(ranks)) != b or any(not 0 <= r < n for r in ranks):
        raise ConfigError(f"threat.ranks={list(ranks)} must list threat.byzantine={b} distinct ranks in [0, {n}).")
    if b > f:
        msg = (f"threat.byzantine={b} actual Byzantine workers exceed the declared threat.f={f}: every rule's "
               f"guarantee assumes at most f.")
        if bool(cfg.strict):
            raise AssumptionError(msg + " Raise threat.f, lower threat.byzantine, or pass strict=false to study "
                                  "breakdown.")
        notes.append(msg)
    return n, f, b, ranks, notes


def _device(cfg: DictConfig) -> tuple[str, str]:
    dev = str(cfg.trainer.device)
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu or cuda; got {dev!r}.")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu.")
    backend = str(cfg.trainer.backend)
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"trainer.backend must be auto, gloo or nccl; got {backend!r}.")
    if backend == "auto":
        backend = "nccl" if dev == "cuda" else "gloo"
    if backend == "nccl" and dev != "cuda":
        why = "" if str(cfg.trainer.device) == "cpu" else " (no CUDA device is visible)"
        raise ConfigError(f"trainer.backend=nccl needs CUDA tensors, but trainer.device is cpu{why}; use "
                          "trainer.backend=gloo (or auto), or trainer.device=cuda on a machine with a GPU.")
    return dev, backend


def _nccl_placement(cfg: DictConfig, n: int, backend: str) -> None:
    """Refuse an NCCL run whose spawned processes outnumber the visible GPUs (NCCL >= 2.5 refuses two
    ranks on one GPU with "Duplicate GPU detected"; checked here, before any process starts).
    Under torchrun the launcher places the processes and this check is left to it."""
    from robustagg.distributed import from_environment

    if backend != "nccl" or Mode(cfg.trainer.mode) is not Mode.processes or from_environment() is not None:
        return
    procs, gpus = int(cfg.trainer.processes) or n, torch.cuda.device_count()
    if procs > gpus:
        raise ConfigError(f"trainer.backend=nccl needs one GPU per process (NCCL refuses two processes on one GPU); "
                          f"this run would start {procs} processes on {gpus} GPU(s). Use trainer.processes={gpus} "
                          f"(each process then hosts several of the {n} workers), trainer.mode=simulated, or "
                          "trainer.backend=gloo.")


def _finite(x: Any) -> bool:
    return math.isfinite(float(x))


def _optimizer_checks(opt: Any) -> list[tuple[bool, str]]:
    """The ranges of :class:`~experiments.config.OptimizerLimits` that the ``optimizer`` node breaks
    (numbers torch does not refuse by itself: ``inf``, ``nan``, a momentum of 1.5)."""
    from robustagg.limits import limit_problems

    if not isinstance(opt, Mapping):
        return []
    return [(False, m) for m in limit_problems(OptimizerLimits, opt, key=lambda k: f"optimizer.{k}")]


def _model_checks(model: DictConfig) -> list[tuple[bool, str]]:
    """Widths and dropout of the shipped models' nodes, when the node has them (any ``_target_`` is
    checked further by building it in :func:`validate`)."""
    checks: list[tuple[bool, str]] = []
    for key, example in (("hidden", "model.hidden=[64] (or [] for a linear model)"), ("channels", "model.channels=[8,16]")):
        if key in model:
            vals = list(model[key])
            what = "layer widths" if key == "hidden" else "conv channels"
            checks.append((all(int(v) >= 1 for v in vals), f"model.{key} lists {what}, each an integer >= 1; got "
                                                           f"{vals}. Use e.g. {example}."))
    if "dropout" in model:
        checks.append((0 <= float(model.dropout) < 1, f"model.dropout must be in [0, 1); got {model.dropout}. Use "
                                                      "e.g. model.dropout=0.1 (0 = none)."))
    return checks


def _callback_checks(callbacks: Any) -> None:
    """Each ``trainer.callbacks`` entry names an importable, callable, allowed ``_target_``.

    Resolved as the workers will (``hydra.utils.instantiate``, with ``_partial_`` so nothing is
    called here): Hydra's target policy refuses some targets (``os.remove``, ``subprocess.run``...).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    for i, cb in enumerate(callbacks):
        key = f"trainer.callbacks[{i}]"
        if not isinstance(cb, Mapping) or not cb.get("_target_"):
            raise ConfigError(f"{key} needs a _target_ (the dotted path of a class or function called as "
                              f"cb(trainer, step_output)); got {cb!r}.")
        target = str(cb["_target_"])
        try:
            instantiate({"_target_": target, "_partial_": True})
        except InstantiationException as exc:
            text = str(exc)
            cause = exc.__cause__
            if "blocklisted" in text:
                why = "is refused by Hydra's instantiate policy (a blocklisted target)"
            elif "Expected a callable target" in text:
                why = "is not callable"
            elif cause is not None:
                inner = cause.__cause__ or cause
                why = f"cannot be imported ({type(inner).__name__}: {inner})"
            else:
                why = f"cannot be used ({text.splitlines()[0]})"
        except Exception as exc:  # anything else the lookup raises: still one message, before launch
            why = f"cannot be used ({type(exc).__name__}: {exc})"
        else:
            continue
        why = " ".join(why.split())  # one line
        raise ConfigError(f"{key}._target_={target!r} {why}; give the dotted path of an importable class or "
                          "function (a module on PYTHONPATH), e.g. mypkg.callbacks.Recorder.") from None


#: A host name: dot-separated labels of letters, digits, '-' and '_' (which some resolvers allow).
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def _rendezvous_checks(cfg: DictConfig) -> None:
    """``trainer.master_addr`` and ``trainer.port``, as the app's launcher will use them.

    The launcher starts every worker on this machine; rank 0 listens on ``master_addr:port``
    (``tcp://host:port``, IPv4) and the others connect. So: the address must be IPv4 or a host name
    with an IPv4 address, and (``trainer.mode=processes``, not under torchrun, which brings its own
    rendezvous) one of this machine's, with the port free: a bind to it, with ``SO_REUSEADDR`` as
    the store uses, is tried and closed at once.
    """
    tr = cfg.trainer
    addr, port = str(tr.master_addr).strip(), int(tr.port)  # the port's range: RunSettings (settings_problems)
    fix = "use e.g. trainer.master_addr=127.0.0.1 (every worker runs on this machine)"
    try:
        ip: Optional[ipaddress.IPv4Address | ipaddress.IPv6Address] = ipaddress.ip_address(addr)
    except ValueError:
        ip = None
    if ip is None and re.fullmatch(r"[0-9.]+", addr):
        raise ConfigError(f"trainer.master_addr={addr!r} is not a valid IPv4 address (four numbers 0..255); {fix}.")
    if ip is None and not _HOSTNAME.fullmatch(addr):
        raise ConfigError(f"trainer.master_addr={addr!r} is neither an IP address nor a host name; {fix}.")
    if ip is not None and ip.version == 6:
        raise ConfigError(f"trainer.master_addr={addr!r} is an IPv6 address; the app's launcher joins its workers "
                          f"over IPv4 (tcp://host:port): {fix}.")
    from robustagg.distributed import from_environment

    if Mode(tr.mode) is not Mode.processes or from_environment() is not None:
        return  # no rendezvous of ours: simulated mode, or torchrun's
    if ip is None:
        try:
            socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise ConfigError(f"trainer.master_addr={addr!r} does not resolve to an IPv4 address ({exc}); "
                              f"{fix}.") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"trainer.port={port} is already in use on {addr}; choose a free port, or "
                                  "trainer.port=0 to pick one.") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"trainer.port={port} on {addr} needs privileges this process lacks (ports "
                                  "below 1024); choose a port above 1024, or trainer.port=0.") from None
            raise ConfigError(f"trainer.master_addr={addr!r} is not an address of this machine ({exc.strerror}): "
                              f"rank 0 of the app's launcher listens on it; {fix}.") from None


def settings_problems(cfg: DictConfig) -> list[str]:
    """The range problems of the configuration's run settings, from the declarations of
    :class:`~robustagg.launch.RunSettings` (:mod:`robustagg.limits`) and of the app's own schema
    (:class:`~experiments.config.TrainConfig`: ``data.max_train_samples``, ...), each message
    naming the key as typed here (:data:`SETTING_KEYS`)."""
    from robustagg.limits import limit_of, limit_problems

    values = {attr: OmegaConf.select(cfg, key) for attr, key in SETTING_KEYS.items()
              if limit_of(RunSettings, attr) is not None}
    return (limit_problems(RunSettings, values, key=lambda a: SETTING_KEYS.get(a, a))
            + limit_problems(TrainConfig, cfg))


def _trainer_checks(cfg: DictConfig) -> None:
    tr = cfg.trainer
    for problem in settings_problems(cfg):  # the ranges RunSettings declares, under the keys typed here
        raise ConfigError(problem)
    checks = [
        (str(tr.reduction) in reduction_modes(),
         f"trainer.reduction must be one of {', '.join(reduction_modes())}; got {tr.reduction!r}."),
        (str(tr.on_nonfinite) in ("abort", "drop"), f"trainer.on_nonfinite must be abort or drop; got {tr.on_nonfinite!r}."),
        (str(tr.start_method) in ("auto", "spawn", "forkserver", "fork"),
         f"trainer.start_method must be auto, spawn, forkserver or fork; got {tr.start_method!r}."),
        (str(cfg.logger.name) in ("wandb", "none"), f"logger must be wandb or none; got {cfg.logger.name!r}."),
        (str(tr.on_failure) in ("restart", "shrink"), f"trainer.on_failure must be restart or shrink; got {tr.on_failure!r}."),
        (str(tr.shrink_shards) in ("drop", "redistribute"),
         f"trainer.shrink_shards must be drop or redistribute; got {tr.shrink_shards!r}."),
        (str(tr.resume) != "", "trainer.resume must be auto, never or a checkpoint folder; got an empty string."),
        *_model_checks(cfg.model),
        *_optimizer_checks(cfg.get("optimizer")),
        *_state_sharding_checks(cfg),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    parse_batched(tr.batched_gradients)  # auto | true | false, named in the message
    _callback_checks(tr.callbacks)
    _rendezvous_checks(cfg)


def _state_sharding_checks(cfg: DictConfig) -> list[tuple[bool, str]]:
    """``trainer.state_sharding=optimizer``: an elementwise optimizer (by its ``_target_``), before any process starts."""
    from robustagg.training.state_sharding import ELEMENTWISE

    if str(cfg.trainer.get("state_sharding", "none")) != "optimizer":
        return []
    target = str((cfg.get("optimizer") or {}).get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    return [(target.startswith("torch.optim.") and name in ELEMENTWISE,
             f"trainer.state_sharding=optimizer needs an optimizer that updates each coordinate from its own gradient "
             f"and state ({', '.join(ELEMENTWISE)} of torch.optim); got optimizer._target_={target}.")]


def _batched_decision(cfg: DictConfig, model: torch.nn.Module, data: DataBundle, ckpt_dir: str) -> Any:
    """``trainer.batched_gradients`` resolved before launch by the library's
    :func:`robustagg.training.batched.resolve_batched`: the model, protocol and precision, and a
    dry run of the batched gradient on two training examples; with ``auto``, the value recorded by
    the checkpoint the run would resume (:func:`robustagg.launch.identity.recorded_value`; an old
    checkpoint without the key: ``false``).

    Returns:
        the :class:`~robustagg.training.batched.BatchedDecision` (``on``: ``True``/``False``).

    Raises:
        ConfigError: ``true`` with a run that cannot be batched, naming ``trainer.batched_gradients``,
            every reason and the fix; a value other than auto, true, false.
    """
    from robustagg.launch.identity import recorded_value
    from robustagg.protocols import DSGD
    from robustagg.training.batched import KEY, resolve_batched, run_shapes

    setting = parse_batched(cfg.trainer.batched_gradients)
    recorded = recorded_value(ckpt_dir, KEY, resume=str(cfg.trainer.resume)) if setting == "auto" else None
    simulated = Mode(cfg.trainer.mode) is Mode.simulated
    processes = int(cfg.trainer.get("processes") or 0)
    n = len(data.parts)
    hosted = n if simulated else max(1, -(-n // processes) if processes > 0 else 1)
    sizes, workers = run_shapes(int(cfg.trainer.batch_size), [len(p) for p in data.parts], hosted)
    return resolve_batched(setting, model, protocol=build_protocol(cfg) or DSGD(), precision=cfg.trainer.precision,
                           example=(data.train_x[:2], data.train_y[:2]), recorded=recorded, batch_sizes=sizes,
                           workers=workers)


def _root_data_check(rule: Aggregator, root_samples: int) -> None:
    """A rule that needs the server's trusted update (FLTrust) gets root data, and only such a rule.

    Raises:
        ConfigError: naming ``server.root_samples`` and the fix.
    """
    final = getattr(rule, "rule", rule)  # a Pipeline's final rule
    if root_samples < 0:
        raise ConfigError(f"server.root_samples must be >= 0; got {root_samples}.")
    if getattr(final, "root", None) == "given" and root_samples == 0:
        raise ConfigError(f"{final.display_name} needs the server's update on a clean root data set: set "
                          "server.root_samples=K (K training examples the server holds, e.g. 100).")
    if root_samples > 0 and not hasattr(final, "set_trusted"):
        raise ConfigError(f"server.root_samples={root_samples} but {final.display_name} takes no trusted update; "
                          "drop the option or use aggregator=fltrust.")


def _hard_violations(rule: Aggregator, n: int) -> list[str]:
    """Violated requirements that are not advisory (the mean's ``f = 0`` is advisory: a baseline)."""
    stages = rule.stages(n) if isinstance(rule, ra.Pipeline) else [(rule.requirement, n, rule.f)]
    return [m for req, rows, f in stages if not req.advisory for m in req.check(rows, f)]


def _rows_note(rule: Aggregator, n: int) -> str:
    if not isinstance(rule, ra.Pipeline):
        return ""
    steps, m = [], n
    for p in rule.pre:
        m2 = p.output_rows(m)
        if m2 != m:
            steps.append(f"preaggregation {p.name} turns the {m} submissions into {m2} rows")
        m = m2
    return f" ({'; '.join(steps)}.)" if steps else ""


def _dry_run_attack(attack: Any, rule: Aggregator, n: int, b: int, name: str) -> None:
    """Call a copy of the attack on small random rows so setting errors surface before launch."""
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(n - b, 6, generator=g)
    adapter = AttackAdapter(copy.deepcopy(attack), copy.deepcopy(rule))
    own = torch.randn(b, 6, generator=g) if adapter.knowledge != "none" else None
    w = torch.randn(6, generator=g) if adapter.needs_parameters else None
    try:
        adapter(honest, b, own, g, parameters=w)
    except RobustAggError as exc:
        # the attack's own assumption (e.g. ALIE's s > 0): skipped in a sweep, like a rule's requirement
        raise AssumptionError(f"attack={name} cannot run with n={n} workers of which {b} Byzantine: {exc}") from None


def follows_steps(cfg: Any) -> list[str]:
    """The scheduler's length keys whose configured value is the interpolation ``${trainer.steps}``
    (``scheduler.T_max`` of ``scheduler=cosine``, ``scheduler.total_steps`` of ``warmup_cosine``; the
    keys of :data:`robustagg.training.schedules.LENGTH_KEYS`): a length that follows the run's. The
    fingerprint records them so, so that a run extended on resume is the same experiment (its
    scheduler then follows the longer schedule: :func:`robustagg.training.schedules.restore_schedule`)."""
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, str) and node.replace(" ", "") == "${trainer.steps}":
            out.append(prefix[:-1])

    from robustagg.training.schedules import LENGTH_KEYS

    walk(raw.get("scheduler") if isinstance(raw, Mapping) else None, "scheduler.")
    return [k for k in out if k.rsplit(".", 1)[-1] in LENGTH_KEYS]  # what restore_schedule stretches


def _command_line_keys() -> Optional[set[str]]:
    """The keys the user typed on this job's command line (Hydra's task overrides), or ``None`` off Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        task = HydraConfig.get().overrides.task
    except Exception:  # pragma: no cover - Hydra internals
        return None
    return {str(o).partition("=")[0].lstrip("+~") for o in task}


def setting_notes(cfg: DictConfig, data: DataBundle, built: list[Any], *, attack_given: bool,
                  byzantine: int) -> list[str]:
    """Settings that run but do nothing, or not what they say: one line each, warned once before launch.

    - an attack with no Byzantine worker to run it (``attack=alie threat.f=0``: the run is "rule vs none");
    - a partition key typed on the command line that the chosen partition does not read
      (``data.shards_per_worker=100`` under ``iid``; :data:`robustagg.data.partition.SCHEME_PARAMETERS`),
      and ``label_sorted`` with at least as many shards per worker as classes (close to iid);
    - what a built object reports itself through ``setting_notes()`` (``model=resnet20`` on 8x8
      digits, a warm-up as long as the run): each of ``built`` (the model's modules, the scheduler)
      that has one.

    Args:
        cfg: the typed configuration. data: the partitioned data. built: objects built from ``cfg``.
        attack_given: an ``attack`` other than ``none`` is configured. byzantine: ``threat.byzantine``.
    """
    from robustagg.data.partition import SCHEME_PARAMETERS

    notes: list[str] = []
    if attack_given and byzantine == 0:
        name = str(cfg.attack.get("_target_", "")).rsplit(".", 1)[-1]
        why = ", which follows threat.f=0" if int(cfg.threat.f) == 0 else ""
        notes.append(f"attack {name} has no Byzantine worker to run it (threat.byzantine=0{why}): this run is {cfg.aggregator.get('_target_', '').rsplit('.', 1)[-1]} with no "
                     "attack. Set threat.f (or threat.byzantine) >= 1 to attack, or attack=none to say so.")
    scheme = str(getattr(cfg.data.partition, "value", cfg.data.partition))
    typed = _command_line_keys() or set()
    readers = {k: s for s, keys in SCHEME_PARAMETERS.items() for k in keys}
    for key in sorted(k.removeprefix("data.") for k in typed if k.startswith("data.")):
        if key in readers and key not in SCHEME_PARAMETERS.get(scheme, ()):
            notes.append(f"data.{key}={cfg.data[key]} does nothing under data.partition={scheme} (only "
                         f"data.partition={readers[key]} reads it).")
    shards = int(cfg.data.shards_per_worker)
    if scheme == "label_sorted" and shards >= data.num_classes:
        notes.append(f"data.shards_per_worker={shards} is at least the {data.num_classes} classes: each worker's "
                     f"shards can cover every class, so label_sorted is close to iid. Use fewer shards per worker "
                     f"(e.g. data.shards_per_worker=2) for label skew.")
    for obj in built:
        report = getattr(obj, "setting_notes", None)
        if callable(report):
            notes += [str(line) for line in report()]
    return list(dict.fromkeys(notes))


def validate(cfg: Any, *, out_dir: str = ".", follows: Optional[list[str]] = None) -> Plan:
    """Check the whole configuration and prepare the data; raise before any process starts.

    Args:
        cfg: the composed configuration (DictConfig or dict).
        out_dir: the run directory recorded in the plan.
        follows: the keys configured as ``${trainer.steps}`` (:func:`follows_steps`), when ``cfg`` is
            already resolved (default: read from ``cfg``).

    Returns:
        a :class:`Plan`.

    Raises:
        ConfigError: misspelt key, unknown rule/attack/map/model, bad values, more Byzantine
            workers than ``f`` under ``strict=true``, an attack that cannot run here, a partition
            leaving a worker without data, or a torchrun world size different from ``threat.n``.
        AssumptionError: the rule's requirement fails for ``threat.n`` and ``threat.f`` (strict).
    """
    follows = follows_steps(cfg) if follows is None else follows
    cfg = as_config(cfg)
    moved_keys(cfg.trainer)
    from .config import run_name_problem

    if cfg.run_name is not None and run_name_problem(str(cfg.run_name)):
        raise ConfigError(run_name_problem(str(cfg.run_name)))
    for key in TARGET_NODES:  # optimizer.lr=fast: one line from the class's signature, before any number is read
        check_target_types(cfg.get(key), key)
    n, f, b, ranks, notes = _threat(cfg)
    _trainer_checks(cfg)
    device, backend = _device(cfg)
    from robustagg.training.precision import parse_precision

    parse_precision(cfg.trainer.precision, device=torch.device(device), allow_cpu_fp16=False)
    _nccl_placement(cfg, n, backend)
    redundancy = _redundancy(cfg, n, f)  # (r, groups, taken-over bound) under protocol=redundant
    rows = n if redundancy is None else redundancy[1]
    rule = build_rule(cfg)
    _root_data_check(rule, int(cfg.server.root_samples))
    mixes = bool(getattr(build_protocol(cfg), "mixes", False))  # protocol=gossip: no server rule to check
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)  # returned below and logged by the caller
        try:
            violations = [] if mixes else rule.check(rows)  # raises AssumptionError under strict
        except AssumptionError as exc:
            note = _rows_note(rule, n) if redundancy is None else _redundancy_note(redundancy, n, f)
            raise AssumptionError(f"{exc}{note}") from None
    if redundancy is not None:
        violations += _redundancy_cover(rule, redundancy, n, f, strict=bool(cfg.strict))
    violations = list(violations) + _protocol_checks(cfg, rule, n)
    attack = build_attack(cfg)
    attack_name, kind = "none", None
    if attack is not None and b > 0:
        attack_name = str(attack.name) or str(cfg.attack.get("_target_"))  # unregistered (mypkg.Shift): its path
        kind = str(getattr(attack.kind, "value", attack.kind))
        if kind == "gradient":
            _dry_run_attack(attack, rule, n, b, attack_name)
    if attack is None or b == 0:
        ranks = ()
    gossip = _gossip_checks(cfg, n, tuple(ranks), kind, attack_name, attack)
    node_rule = gossip.label
    violations = list(violations) + [f"protocol=gossip: {v}" for v in gossip.violations]
    data = build_data(cfg.data, n=n, byzantine_ranks=ranks, seed=int(cfg.seed))
    if redundancy is not None:  # every replica of a group holds the group's pooled shard
        from robustagg.protocols.redundant import pool_parts

        r = redundancy[0]
        data.parts = pool_parts(data.parts, r)
        if data.shifts is not None:
            data.shifts = data.shifts[[w - w % r for w in range(n)]].clone()
    if kind == "data" and hasattr(attack, "poison_batch"):  # a backdoor: the target and trigger fit the data
        try:
            attack.poison_batch(data.train_x[:2], data.train_y[:2], data.num_classes)
        except RobustAggError as exc:
            raise ConfigError(f"attack={attack_name} does not fit data={cfg.data.name}: {exc}") from None
    plan = Plan(cfg={}, n=n, f=f, byzantine_ranks=tuple(ranks), rule_name=node_rule or str(rule.name) or str(cfg.aggregator.get("_target_")), attack_name=attack_name,
                attack_kind=kind, data=data, device=device, backend=backend, out_dir=str(out_dir))
    # Builds the model and optimizer once here: checks the model fits the data, and imports what
    # torch.optim imports lazily (seconds of CPU) before worker processes are forked.
    model, _, scheduler = build_model_and_optimizer(data, cfg, torch.device("cpu"))
    if node_rule is not None and any(buf.is_floating_point() for buf in model.buffers()):
        raise ConfigError(f"protocol=gossip keeps one parameter vector per node; model {cfg.model.get('_target_')} has "
                          "floating buffers (BatchNorm running statistics), which are not per node yet: use a model "
                          "without them (model=mlp, lenet5).")
    advice = setting_notes(cfg, data, [*model.modules(), scheduler], attack_given=attack is not None, byzantine=b)
    for cb in cfg.trainer.callbacks:
        if not isinstance(cb, Mapping) or not cb.get("_target_"):
            raise ConfigError(f"trainer.callbacks entries need a _target_; got {cb!r}.")
    from robustagg.distributed import from_environment

    env = from_environment()
    if env is not None and Mode(cfg.trainer.mode) is Mode.processes and env.world_size != n:
        raise ConfigError(f"torchrun started {env.world_size} processes but threat.n={n}; one process per worker "
                          f"is needed (torchrun --nproc-per-node ... with a total of {n}).")
    from robustagg.launch import code_revision, fingerprint

    from .recovery import check_faults, checkpoint_dir

    plan.faults = check_faults(cfg, n, under_torchrun=env is not None)
    plan.ckpt_dir = checkpoint_dir(cfg, str(out_dir))
    batched = _batched_decision(cfg, model, data, plan.ckpt_dir)
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    container["trainer"]["batched_gradients"] = batched.on  # the resolved value, never auto: identity, files, Job
    plan.batched_gradients = batched.describe()
    plan.cfg = {str(k): v for k, v in container.items()}
    plan.violations = list(violations) + notes
    plan.assumption_violated = (not mixes and bool(_hard_violations(rule, rows))) or b > f or any(
        v.startswith("protocol=") for v in violations) or (
        redundancy is not None and int(getattr(rule, "f", 0)) < redundancy[2])
    if redundancy is not None:
        plan.notes.append(_redundancy_note(redundancy, n, f).strip(" ()").rstrip(".")
                          + f"; the rule {rule.display_name} runs with f={getattr(rule, 'f', 0)}.")
    plan.notes += advice + gossip.notes
    plan.run_id = uuid.uuid4().hex[:12]
    plan.identities = tuple(range(n))
    plan.fingerprint = fingerprint(plan.cfg)
    plan.fingerprint.update(gossip.identity)
    from robustagg.launch.identity import FOLLOWS_STEPS

    plan.fingerprint.update({k: FOLLOWS_STEPS for k in follows if k in plan.fingerprint})  # extending follows
    plan.code_revision = code_revision()
    plan.job().settings.check()  # the library's own checks (Job: the schedule against n and the rule)
    return plan


def build_byzantine(ranks: tuple[int, ...], cfg: DictConfig, rule: Aggregator, *, attack_kind: Optional[str],
                    attack_name: str) -> Optional[ByzantineBehaviour]:
    """The injected Byzantine behaviour over the current ``ranks`` (``None`` when nobody attacks)."""
    if not ranks:
        return None
    attack = build_attack(cfg)
    if attack is None:
        return None
    seed = ra_seed(int(cfg.seed), 0xA77AC)
    start = int(cfg.threat.start_step)
    if attack_kind == "data" and hasattr(attack, "poison_batch"):
        # backdoors: the batch (inputs and labels) is poisoned, and the gradient on it goes through
        # the attack (unchanged for BadNets/DBA, boosted for model replacement)
        return ByzantineBehaviour(ranks=ranks, batch_poison_fn=attack.poison_batch,
                                  gradient_fn=AttackAdapter(attack, rule), start_step=start, seed=seed,
                                  name=attack_name)
    if attack_kind == "data":
        return ByzantineBehaviour(ranks=ranks, poison_fn=attack.poison_labels, start_step=start, seed=seed,
                                  name=attack_name)
    if attack_kind == "gossip":  # protocol=gossip calls it per receiver (validate checked the protocol)
        return ByzantineBehaviour(ranks=ranks, gossip_fn=attack, start_step=start, seed=seed, name=attack_name)
    adapter = AttackAdapter(attack, rule)
    return ByzantineBehaviour(ranks=ranks, gradient_fn=adapter, start_step=start, seed=seed, name=attack_name,
                              needs_exchange=adapter.knowledge != "none", needs_parameters=adapter.needs_parameters)


def ra_seed(*parts: int) -> int:
    """A derived 63-bit seed (see :func:`robustagg.training.mix_seed`)."""
    from robustagg.training import mix_seed

    return mix_seed(*parts)


def build_model_and_optimizer(data: DataBundle, cfg: DictConfig,
                              device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """The ``model`` node (initialised from ``cfg.seed``, identical in every process), behind the
    per-worker crop + flip when ``data`` asks for it (:func:`experiments.data.augment_enabled`),
    the ``optimizer`` over its parameters and the ``scheduler`` (or ``None``).

    Raises:
        ConfigError: a model, optimizer or scheduler node that cannot be built (the message names it).
    """
    torch.manual_seed(ra_seed(int(cfg.seed), 0x30DE1))
    model = instantiate_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    if augment_enabled(cfg.data):
        from robustagg.data import Augment

        model = torch.nn.Sequential(Augment(data.input_shape), model)
    model = model.to(device)
    opt = build_optimizer(cfg.get("optimizer"), model.parameters())
    return model, opt, build_scheduler(cfg.get("scheduler"), opt)
