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
import inspect
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import robustagg as ra
from robustagg.aggregators.base import Aggregator
from robustagg.distributed import reduction_modes
from robustagg.errors import AssumptionError, AssumptionWarning, ConfigError, RobustAggError
from robustagg.data import DataBundle
from robustagg.launch import Job, RunSettings, WorkerContext, WorkerParts
from robustagg.preaggregation.base import PreAggregator
from robustagg.training import AttackAdapter, ByzantineBehaviour, Fault, evaluate

from .config import FaultConf, Mode, TrainConfig
from .data import augment_enabled, build_data
from .models import instantiate_model
from .optim import build_optimizer, build_scheduler, moved_keys

__all__ = ["Plan", "ExperimentBuild", "as_config", "validate", "build_rule", "build_attack", "build_byzantine",
           "build_model_and_optimizer", "AttackAdapter", "rule_names"]


def rule_names() -> list[str]:
    """Registered names of the final rules (pre-aggregation maps excluded)."""
    return [n for n in ra.available() if issubclass(ra.lookup(n), Aggregator) and n != "pipeline"]


def _attack_names() -> list[str]:
    import attacks

    return list(attacks.available())


def as_config(cfg: Any) -> DictConfig:
    """Merge ``cfg`` (a DictConfig or dict) into the typed schema, so misspelt keys fail here.

    Raises:
        ConfigError: unknown key, wrong type, or a missing required value.
    """
    try:
        base = OmegaConf.structured(TrainConfig)
        merged = OmegaConf.merge(base, cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg))
        OmegaConf.resolve(merged)
        for name in list(merged.faults):
            node = merged.faults[name]
            if not isinstance(node, DictConfig):
                raise ConfigError(f"faults.{name} must be a mapping with a kind (see conf/faults/); got {node!r}.")
            merged.faults[name] = OmegaConf.merge(OmegaConf.structured(FaultConf), node)
        return merged  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {exc}".replace("\n", " ").strip()) from None


def _resolve_target(node: Any, *, what: str, base: type, names: list[str], prefix: str) -> tuple[type, dict[str, Any]]:
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

    cls, params = _resolve_target(node, what="attack", base=attacks.Attack, names=["none"] + _attack_names(),
                                  prefix="attack")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"attack {cls.__name__}: {exc}") from None


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

    def config(self) -> DictConfig:
        """:attr:`cfg` as a DictConfig."""
        return OmegaConf.create(self.cfg)  # type: ignore[return-value]

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
            logger=dict(self.cfg["logger"]))
        meta = {"rule": self.rule_name, "attack": self.attack_name, "data": self.data.name,
                "partition": self.data.partition, "worker_sizes": self.data.sizes(),
                "label_skew": self.data.label_skew(), "code_revision": self.code_revision}
        return Job(build=ExperimentBuild(cfg=self.cfg, data=self.data, attack_kind=self.attack_kind,
                                         attack_name=self.attack_name),
                   n=self.n, run_dir=self.out_dir, settings=settings, f=self.f, rule=build_rule(cfg),
                   byzantine_ids=self.byzantine_ranks, identities=self.identities, fingerprint=dict(self.fingerprint),
                   faults=list(self.faults), name=f"{self.rule_name}-{self.attack_name}", meta=meta, config=self.cfg,
                   run_id=self.run_id, violations=list(self.violations), assumption_violated=self.assumption_violated,
                   data_sizes={w: int(len(p)) for w, p in enumerate(self.data.parts)})


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
        rule = build_rule(cfg)
        byzantine = build_byzantine(ctx.byzantine_ranks, cfg, rule, attack_kind=self.attack_kind,
                                    attack_name=self.attack_name)
        shards = {}
        for r in ctx.local_ranks:
            s = ctx.shard(r, self.data.shard)
            s.x, s.y = s.x.to(device), s.y.to(device)
            shards[r] = s
        test_x, test_y = self.data.test_x.to(device), self.data.test_y.to(device)
        num_classes = self.data.num_classes

        def eval_fn() -> dict[str, float]:
            return evaluate(model, test_x, test_y, num_classes)

        return WorkerParts(model=model, optimizer=optimizer, rule=rule, shards=shards, scheduler=scheduler,
                           byzantine=byzantine, evaluate=eval_fn, num_classes=num_classes,
                           callbacks=[instantiate(c) for c in cfg.trainer.callbacks])


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
    if backend == "auto":
        backend = "nccl" if dev == "cuda" else "gloo"
    if backend not in ("gloo", "nccl") or (backend == "nccl" and dev != "cuda"):
        raise ConfigError(f"trainer.backend must be auto, gloo or nccl (nccl needs trainer.device=cuda); got {backend!r}.")
    return dev, backend


def _trainer_checks(cfg: DictConfig) -> None:
    tr = cfg.trainer
    checks = [
        (int(tr.steps) >= 0, f"trainer.steps must be >= 0; got {tr.steps}."),
        (int(tr.batch_size) >= 1, f"trainer.batch_size must be >= 1; got {tr.batch_size}."),
        (0 <= float(tr.worker_momentum) < 1, f"trainer.worker_momentum must be in [0, 1); got {tr.worker_momentum}."),
        (int(tr.threads) >= 1, f"trainer.threads must be >= 1; got {tr.threads}."),
        (int(tr.eval_every) >= 0 and int(tr.param_check_every) >= 0,
         "trainer.eval_every and trainer.param_check_every must be >= 0."),
        (str(tr.reduction) in reduction_modes(),
         f"trainer.reduction must be one of {', '.join(reduction_modes())}; got {tr.reduction!r}."),
        (str(tr.on_nonfinite) in ("abort", "drop"), f"trainer.on_nonfinite must be abort or drop; got {tr.on_nonfinite!r}."),
        (str(tr.start_method) in ("auto", "spawn", "forkserver", "fork"),
         f"trainer.start_method must be auto, spawn, forkserver or fork; got {tr.start_method!r}."),
        (float(tr.collective_timeout_s) > 0, f"trainer.collective_timeout_s must be > 0; got {tr.collective_timeout_s}."),
        (str(cfg.logger.name) in ("wandb", "none"), f"logger must be wandb or none; got {cfg.logger.name!r}."),
        (int(tr.checkpoint.every) >= 0, f"trainer.checkpoint.every must be >= 0 steps; got {tr.checkpoint.every}."),
        (int(tr.checkpoint.keep) >= 1, f"trainer.checkpoint.keep must be >= 1; got {tr.checkpoint.keep}."),
        (int(tr.max_restarts) >= 0, f"trainer.max_restarts must be >= 0; got {tr.max_restarts}."),
        (str(tr.on_failure) in ("restart", "shrink"), f"trainer.on_failure must be restart or shrink; got {tr.on_failure!r}."),
        (str(tr.shrink_shards) in ("drop", "redistribute"),
         f"trainer.shrink_shards must be drop or redistribute; got {tr.shrink_shards!r}."),
        (float(tr.straggler_factor) > 1, f"trainer.straggler_factor must be > 1; got {tr.straggler_factor}."),
        (str(tr.resume) != "", "trainer.resume must be auto, never or a checkpoint folder; got an empty string."),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


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
    try:
        adapter(honest, b, own, g)
    except RobustAggError as exc:
        # the attack's own assumption (e.g. ALIE's s > 0): skipped in a sweep, like a rule's requirement
        raise AssumptionError(f"attack={name} cannot run with n={n} workers of which {b} Byzantine: {exc}") from None


def validate(cfg: Any, *, out_dir: str = ".") -> Plan:
    """Check the whole configuration and prepare the data; raise before any process starts.

    Args:
        cfg: the composed configuration (DictConfig or dict).
        out_dir: the run directory recorded in the plan.

    Returns:
        a :class:`Plan`.

    Raises:
        ConfigError: misspelt key, unknown rule/attack/map/model, bad values, more Byzantine
            workers than ``f`` under ``strict=true``, an attack that cannot run here, a partition
            leaving a worker without data, or a torchrun world size different from ``threat.n``.
        AssumptionError: the rule's requirement fails for ``threat.n`` and ``threat.f`` (strict).
    """
    cfg = as_config(cfg)
    moved_keys(cfg.trainer)
    n, f, b, ranks, notes = _threat(cfg)
    _trainer_checks(cfg)
    device, backend = _device(cfg)
    rule = build_rule(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)  # returned below and logged by the caller
        try:
            violations = rule.check(n)  # raises AssumptionError under strict
        except AssumptionError as exc:
            raise AssumptionError(f"{exc}{_rows_note(rule, n)}") from None
    attack = build_attack(cfg)
    attack_name, kind = "none", None
    if attack is not None and b > 0:
        attack_name = str(attack.name)
        kind = str(getattr(attack.kind, "value", attack.kind))
        if kind == "gradient":
            _dry_run_attack(attack, rule, n, b, attack_name)
    if attack is None or b == 0:
        ranks = ()
    data = build_data(cfg.data, n=n, byzantine_ranks=ranks, seed=int(cfg.seed))
    plan = Plan(cfg={}, n=n, f=f, byzantine_ranks=tuple(ranks), rule_name=str(rule.name), attack_name=attack_name,
                attack_kind=kind, data=data, device=device, backend=backend, out_dir=str(out_dir))
    # Builds the model and optimizer once here: checks the model fits the data, and imports what
    # torch.optim imports lazily (seconds of CPU) before worker processes are forked.
    build_model_and_optimizer(data, cfg, torch.device("cpu"))
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
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    plan.cfg = {str(k): v for k, v in container.items()}
    plan.violations = list(violations) + notes
    plan.assumption_violated = bool(_hard_violations(rule, n)) or b > f
    plan.run_id = uuid.uuid4().hex[:12]
    plan.identities = tuple(range(n))
    plan.fingerprint = fingerprint(plan.cfg)
    plan.code_revision = code_revision()
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
    if attack_kind == "data":
        return ByzantineBehaviour(ranks=ranks, poison_fn=attack.poison_labels, start_step=start, seed=seed,
                                  name=attack_name)
    adapter = AttackAdapter(attack, rule)
    return ByzantineBehaviour(ranks=ranks, gradient_fn=adapter, start_step=start, seed=seed, name=attack_name,
                              needs_exchange=adapter.knowledge != "none")


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
