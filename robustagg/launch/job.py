"""What a supervised run is: a :class:`Job` (picklable), the :class:`WorkerContext` each process gets,
and the :class:`WorkerParts` the job's ``build`` returns.

A job is data plus one function. ``build(ctx)`` runs in every worker process (or once in the
simulated mode) and returns the objects of :class:`~robustagg.training.Trainer` for the workers that
process hosts. Everything else (spawning, restore, checkpoints, restarts, elastic shrink, evidence,
the run lock, signals, the run files) is the library's: :func:`robustagg.launch.launch` runs a job.

Worker ids and ranks: a worker keeps its *worker id* (its rank in the original group) for its
whole life; an elastic shrink renumbers the ranks ``0..n'-1`` over the survivors. ``build`` keys
data by worker id (:meth:`WorkerContext.shard`), so the survivors keep their data, batches and RNG
streams.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..aggregators.base import Aggregator
from ..errors import AssumptionError, AssumptionWarning, ConfigError
from ..limits import limit, limit_problems

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.comm import Communicator
    from ..protocols.base import Protocol
    from ..training.byzantine import ByzantineBehaviour
    from ..training.faults import Fault
    from ..training.trainer import Shard

__all__ = ["RunSettings", "WorkerContext", "WorkerParts", "Job", "shrink_job", "grow_job", "MAX_THREADS",
           "MIN_TIMEOUT_S", "MAX_TIMEOUT_S"]

#: The most torch threads per process accepted: more is a typo (a million threads crash the process
#: and exhaust the machine's process table for everyone).
MAX_THREADS = 256
#: The shortest and longest collective timeout accepted, in seconds: a group's own rendezvous takes
#: longer than a second on a loaded machine; longer than a day is a hang by another name.
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86400.0


@dataclass
class RunSettings:
    """How the library runs and supervises a job (the trainer's knobs that are not the experiment's objects).

    Each numeric field declares its type, range and meaning once (:func:`~robustagg.limits.limit`
    metadata), and :meth:`check` derives the range checks and their messages from those declarations.

    Attributes:
        mode: ``"processes"`` (one OS process per worker, or the group torchrun started) or
            ``"simulated"`` (every worker in this process; bit-identical on CPU with one thread).
        steps: total optimizer steps of the run (a resumed run continues up to it).
        batch_size: examples per worker per step (for :class:`~robustagg.training.Shard` data).
        seed: the run's seed (data order, worker RNG streams).
        worker_momentum: beta in ``[0, 1)`` of each worker's momentum (0 = off).
        eval_every: evaluate every K steps, before the first step of a fresh run (step 0) and at
            the end (0: only at the end). param_check_every: compare
            parameter and optimizer digests across ranks every K steps (0: only at the end).
        reduction: ``auto``, ``gather`` or ``sharded``. on_nonfinite: ``abort`` or ``drop``.
        metrics: per-step ``agg/*`` metrics. progress: a progress bar on rank 0.
        device: ``cpu`` or ``cuda``. backend: ``gloo`` or ``nccl``. threads: torch threads per process
            (1 .. :data:`MAX_THREADS`).
        start_method: ``fork``, ``spawn``, ``forkserver`` or ``auto`` (fork on Linux with CPU).
        collective_timeout_s: seconds a collective waits (``MIN_TIMEOUT_S`` = 1 to
            ``MAX_TIMEOUT_S`` = 86,400). master_addr, port: rendezvous of spawned workers (port 0: a free one).
        checkpoint_every: committed checkpoint every K steps and at the end (0: none).
        checkpoint_keep: committed checkpoints kept. ckpt_dir: the checkpoint folder (empty:
            ``<run_dir>/checkpoints``).
        resume: ``auto``, ``never`` or one checkpoint folder. resume_changes: ``refuse`` or ``allow``
            a resume whose experiment fingerprint differs (see :mod:`~robustagg.launch.identity`).
        max_restarts: restarts of the group by the app's own launcher after a failure.
        on_failure: ``restart`` (same n) or ``shrink`` (without the lost workers, if the rule allows).
        shrink_shards: the lost workers' data is ``drop``-ped or ``redistribute``-d.
        straggler_factor: flag a rank waited for more than this many step medians.
        processes: OS processes hosting the n workers in ``processes`` mode (0: one per worker; P:
            contiguous blocks, :func:`~robustagg.distributed.comm.block_hosts`). A process that
            hosts several workers cannot be shrunk around one of them (``on_failure=shrink`` is
            refused).
        measure_bias: ``agg/bias_vs_sync`` every update (see :class:`~robustagg.training.Trainer`).
        precision: ``"32"``, ``"bf16"`` (CPU or CUDA) or ``"fp16"`` (meant for CUDA; accepted on CPU,
            where it is slow, and refused there by the experiment app) autocast of the workers'
            forward pass and loss (:mod:`~robustagg.training.precision`).
        batched_gradients: ``"auto"`` (default), ``True`` or ``False``: every process computes its
            hosted workers' gradients of an update in one ``torch.func.vmap`` call
            (:mod:`~robustagg.training.batched`). ``True`` refuses a model, protocol or precision
            that cannot be batched when the trainer is built; ``"auto"`` is decided by
            :func:`~robustagg.training.batched.resolve_batched` (the app's decision): before launch
            the launcher keeps the resumed checkpoint's ``False`` (the loop), and every process
            decides on its built model, protocol, precision and a dry run on two examples of its
            first hosted shard; the decision is logged, recorded in the summary
            (``batched_gradients``, ``batched_gradients_reason``) and, where :attr:`Job.fingerprint`
            holds ``trainer.batched_gradients``, written there as ``True``/``False``.
        rejoin: with ``on_failure="shrink"``: after a shrink the launcher starts a replacement for
            every lost worker id, which joins the running group at a step boundary with the state
            of a live peer (:mod:`~robustagg.launch.grow`).
        peer_copy: with ``rejoin``: every survivor keeps in memory the last committed own state
            (data position, RNG streams, momentum, per-worker protocol state) of the absent
            workers it holds in the ring; a replacement takes it when its disk copy is older or
            missing, after checking its SHA-256 against the committed manifests
            (:mod:`~robustagg.launch.peer`).
        state_sharding: ``none`` or ``optimizer``: each process owns the optimizer state of the
            coordinate slice it aggregates and applies the server step to it alone, the slices
            all-gathered after (:mod:`~robustagg.training.state_sharding`; needs
            ``mode=processes``, ``reduction=sharded``, one worker per process, an elementwise
            optimizer, protocol ``dsgd``; a replacement that rejoins gets its slice cut from the
            members' shards).
        shard_redundancy: ``k``: with ``state_sharding=optimizer``, each slice's state is also
            held by the next ``k - 1`` ranks (1: no copies); shard_parity: ``g``: an XOR parity
            of every group of ``g`` slices (0: none). Either lets the survivors of a shrink
            rebuild a lost rank's shard without replaying steps; needs ``on_failure=shrink``
            (:mod:`~robustagg.training.shard_recovery`).
        aggregator_replicas: ``r_a``, ranks that compute each coordinate slice of the aggregate
            (``reduction=sharded``; 1: each slice once, not cross-checked).
        lying_aggregators: ``f_a``, the declared number of lying aggregator ranks; the requirement
            ``r_a >= 2 f_a + 1`` (``vote``) or ``r_a >= f_a + 1`` (``abort``) is checked before
            launch (:meth:`Job.aggregator_requirement`). on_aggregate_mismatch: ``abort`` or ``vote``.
            on_lying_aggregator: ``continue`` or ``exclude`` (the launcher shrinks the named ranks out:
            needs ``on_failure="shrink"`` and a restart). See :mod:`~robustagg.distributed.vote`.
        membership: simulated mode: a schedule of absences ``[{"workers": [ids], "absent": [a, b]}]``
            (workers absent in the 1-based steps ``a .. b-1``), the reference of a run that shrank
            and grew (:mod:`~robustagg.launch.schedule`).
        logger: ``{"name": "wandb"|"none", "project", "entity", "mode", "group", "tags"}``.
        key_names: ``{attribute: the key a user types}`` for messages (an app's configuration
            names, e.g. ``{"resume_changes": "trainer.resume_changes"}``; default: the attribute).
    """

    mode: str = "processes"
    steps: int = field(default=100, metadata=limit(0, None, "optimizer steps", integer=True))
    batch_size: int = field(default=32, metadata=limit(1, None, "examples per worker per step", integer=True))
    seed: int = 0
    worker_momentum: float = field(default=0.0, metadata=limit(0, 1, "beta of each worker's momentum, 0 = off",
                                                                high_open=True))
    eval_every: int = field(default=0, metadata=limit(0, None, "steps between evaluations, 0 = at the end",
                                                      integer=True))
    param_check_every: int = field(default=0, metadata=limit(0, None, "steps between digest checks, 0 = at the end",
                                                             integer=True))
    reduction: str = "auto"
    on_nonfinite: str = "abort"
    metrics: bool = True
    progress: bool = False
    device: str = "cpu"
    backend: str = "gloo"
    threads: int = field(default=1, metadata=limit(1, MAX_THREADS, "torch threads per process", integer=True))
    start_method: str = "auto"
    collective_timeout_s: float = field(default=60.0, metadata=limit(
        MIN_TIMEOUT_S, MAX_TIMEOUT_S, "seconds a collective waits for the others: at least a second, at most a day",
        example=60))
    master_addr: str = "127.0.0.1"
    port: int = field(default=0, metadata=limit(0, 65535, "a TCP port, 0 = pick a free one", integer=True))
    checkpoint_every: int = field(default=0, metadata=limit(0, None, "steps between committed checkpoints, 0 = none",
                                                            integer=True))
    checkpoint_keep: int = field(default=3, metadata=limit(1, None, "committed checkpoints kept", integer=True))
    ckpt_dir: str = ""
    resume: str = "auto"
    resume_changes: str = "refuse"
    max_restarts: int = field(default=0, metadata=limit(0, None, "restarts after a failure", integer=True))
    on_failure: str = "restart"
    shrink_shards: str = "drop"
    straggler_factor: float = field(default=10.0, metadata=limit(1, None, "step medians that make a straggler",
                                                                 low_open=True))
    processes: int = field(default=0, metadata=limit(0, None, "OS processes hosting the workers, 0 = one each",
                                                     integer=True))
    measure_bias: bool = False
    precision: str = "32"
    batched_gradients: Union[bool, str] = "auto"
    rejoin: bool = False
    peer_copy: bool = False
    aggregator_replicas: int = field(default=1, metadata=limit(1, None, "ranks that compute each slice of the aggregate",
                                                               integer=True))
    lying_aggregators: int = field(default=0, metadata=limit(0, None, "declared lying aggregator ranks", integer=True))
    on_aggregate_mismatch: str = "abort"
    on_lying_aggregator: str = "continue"
    state_sharding: str = "none"
    shard_redundancy: int = field(default=1, metadata=limit(1, None, "ranks that hold each slice's optimizer state",
                                                            integer=True))
    shard_parity: int = field(default=0, metadata=limit(0, None, "slices per parity group (0: no parity)",
                                                        integer=True))
    membership: list[Any] = field(default_factory=list)
    logger: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    key_names: dict[str, str] = field(default_factory=dict)

    def key(self, attr: str) -> str:
        """The name a user typed for setting ``attr`` (``key_names``, e.g. ``trainer.resume_changes``; else ``attr``)."""
        return self.key_names.get(attr, attr)

    def check(self) -> None:
        """Refuse values that cannot work (before any process starts).

        The numeric ranges are declared once, on the fields (:func:`~robustagg.limits.limit`), and
        checked by :func:`~robustagg.limits.limit_problems`; an app checks its configuration with
        the same declarations (``limit_problems(RunSettings, values, key=...)``) before it builds
        the settings, so both refuse the same values with the same message.

        Raises:
            ConfigError: naming the setting, the value and the allowed range (the first problem).
        """
        choices = {"mode": ("processes", "simulated"), "on_nonfinite": ("abort", "drop"),
                   "device": ("cpu", "cuda"), "backend": ("gloo", "nccl"),
                   "start_method": ("auto", "fork", "spawn", "forkserver"), "resume_changes": ("refuse", "allow"),
                   "on_failure": ("restart", "shrink"), "shrink_shards": ("drop", "redistribute"),
                   "on_aggregate_mismatch": ("abort", "vote"), "on_lying_aggregator": ("continue", "exclude"),
                   "state_sharding": ("none", "optimizer")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{self.key(key)} must be one of {', '.join(allowed)}; got {getattr(self, key)!r}.")
        for problem in limit_problems(RunSettings, self, key=self.key):  # the ranges declared on the fields
            raise ConfigError(problem)
        if self.rejoin and self.on_failure != "shrink":
            raise ConfigError(f"{self.key('rejoin')}=true needs {self.key('on_failure')}=shrink (a lost worker first "
                              f"leaves the group, then its replacement joins it); got on_failure={self.on_failure}.")
        if self.on_lying_aggregator == "exclude" and (self.mode != "processes" or self.on_failure != "shrink"
                                                      or int(self.max_restarts) < 1
                                                      or self.on_aggregate_mismatch != "vote"):
            raise ConfigError(f"{self.key('on_lying_aggregator')}=exclude removes a named rank through the launcher's "
                              f"shrink path: it needs {self.key('mode')}=processes, {self.key('on_failure')}=shrink, "
                              f"{self.key('max_restarts')} >= 1 and {self.key('on_aggregate_mismatch')}=vote (a rank is "
                              f"named only by a vote); got mode={self.mode}, on_failure={self.on_failure}, "
                              f"max_restarts={self.max_restarts}, on_aggregate_mismatch={self.on_aggregate_mismatch}.")
        if int(self.aggregator_replicas) > 1 and self.reduction == "gather":
            raise ConfigError(f"{self.key('aggregator_replicas')}={self.aggregator_replicas} replicates the slices of "
                              f"{self.key('reduction')}=sharded; with gather every rank computes the whole aggregate "
                              f"already: set {self.key('on_aggregate_mismatch')}=vote to outvote a lying rank, or "
                              f"{self.key('reduction')}=sharded.")
        if self.state_sharding == "optimizer":
            wrong = [f"{self.key(k)}={getattr(self, k)}" for k, ok in (
                ("mode", self.mode == "processes"), ("reduction", self.reduction == "sharded"),
                ("processes", int(self.processes) == 0)) if not ok]
            if wrong:
                raise ConfigError(f"{self.key('state_sharding')}=optimizer gives each process the optimizer state of "
                                  f"the slice it aggregates: it needs {self.key('mode')}=processes and "
                                  f"{self.key('reduction')}=sharded with one worker per process "
                                  f"({self.key('processes')}=0); got {', '.join(wrong)}.")
        if int(self.shard_redundancy) != 1 or int(self.shard_parity) != 0:
            which = (f"{self.key('shard_redundancy')}={self.shard_redundancy}" if int(self.shard_redundancy) != 1
                     else f"{self.key('shard_parity')}={self.shard_parity}")
            if self.state_sharding != "optimizer" or self.on_failure != "shrink":
                raise ConfigError(f"{which} keeps a second source of each rank's optimizer-state shard for the "
                                  f"survivors of a shrink: it needs {self.key('state_sharding')}=optimizer and "
                                  f"{self.key('on_failure')}=shrink; got state_sharding={self.state_sharding}, "
                                  f"on_failure={self.on_failure}.")
        if self.peer_copy and not self.rejoin:
            raise ConfigError(f"{self.key('peer_copy')}=true keeps the lost workers' own state for their replacements: "
                              f"it needs {self.key('rejoin')}=true (and {self.key('on_failure')}=shrink).")
        if self.membership:
            if self.mode != "simulated":
                raise ConfigError(f"{self.key('membership')} replays membership changes in simulated mode only (the "
                                  f"reference of a run that shrank and grew); set {self.key('mode')}=simulated, or let "
                                  f"a processes run change its membership through faults with "
                                  f"{self.key('on_failure')}=shrink and {self.key('rejoin')}=true.")
            from .schedule import parse_membership

            parse_membership(self.membership, key=self.key("membership"))
        if self.resume == "":
            raise ConfigError(f"{self.key('resume')} must be auto, never or a checkpoint folder; got an empty string.")
        from ..training.batched import parse_batched
        from ..training.precision import parse_precision

        parse_precision(self.precision)  # fp16 on CPU is the app's to refuse (the library runs it, for tests)
        parse_batched(self.batched_gradients, key=self.key("batched_gradients"))


@dataclass
class WorkerParts:
    """What ``Job.build`` returns for the workers one process hosts.

    Attributes:
        model: the model, initialised identically in every process (seed it in ``build``).
        optimizer: over ``model.parameters()`` (any ``torch.optim`` optimizer; its full state is
            checkpointed and compared across ranks).
        rule: the robust rule (an :class:`~robustagg.aggregators.base.Aggregator`, pipelines included).
        shards: ``{rank: Shard | BatchSource}`` for exactly ``ctx.local_ranks`` (see
            :class:`~robustagg.training.Trainer`).
        scheduler: an optional learning-rate scheduler (checkpointed).
        byzantine: the :class:`~robustagg.training.ByzantineBehaviour` over the *current* ranks
            (``ctx.byzantine_ranks``), or ``None``.
        evaluate: ``() -> {"test/acc": ..., ...}`` called on rank 0, or ``None``.
        num_classes: handed to a label poison.
        loss_fn: ``(model outputs, labels) -> scalar`` (default cross-entropy), or, with
            ``batch_loss``, ignored.
        batch_loss: ``(model, batch) -> scalar``: the loss over any batch a source yields.
        callbacks: ``cb(trainer, step_output)`` after every step, on every rank.
        root: the server's clean root data set (the same in every process) for a rule that takes
            a trusted update (FLTrust), or ``None``.
        protocol: the training :class:`~robustagg.protocols.Protocol` (``None``:
            :class:`~robustagg.protocols.DSGD`).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rule: Aggregator
    shards: Mapping[int, Any]
    scheduler: Any = None
    byzantine: Optional["ByzantineBehaviour"] = None
    evaluate: Optional[Callable[[], dict[str, float]]] = None
    num_classes: int = 0
    loss_fn: Optional[Callable[..., torch.Tensor]] = None
    batch_loss: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None
    callbacks: Sequence[Callable[..., None]] = ()
    root: Optional["Shard"] = None
    protocol: Optional["Protocol"] = None


@dataclass
class Job:
    """A run the library launches, supervises and restores (picklable: it travels to every process).

    Args:
        build: ``build(ctx: WorkerContext) -> WorkerParts``, called in every worker process. A
            module-level function or a picklable callable object (``spawn`` and ``forkserver`` pickle
            the job; ``fork`` does not).
        n: number of workers (the current membership's size).
        run_dir: the run directory (run files, ``metrics.jsonl``, ``checkpoints/``, the run lock).
        settings: :class:`RunSettings`.
        f: the declared Byzantine bound (recorded; the rule carries its own ``f``).
        rule: a prototype of the rule, used by the launcher to check its requirement before launch
            and at every membership change (``None``: not checked by the launcher).
        byzantine_ids: the worker ids that are Byzantine (they keep their role through a shrink).
        identities: the worker id of every rank (default ``range(n)``).
        fingerprint: the experiment's identity (:func:`~robustagg.launch.identity.fingerprint`),
            written into every manifest and compared before a resume. Not changed by a shrink.
        faults: injected :class:`~robustagg.training.Fault` s (processes mode).
        name: a title for the console and W&B.
        meta: more summary fields (the setting: rule, attack, data, ...).
        config: the resolved configuration to store with the W&B run (plain containers).
        run_id: a random id (kept across restarts; filled in by :func:`~robustagg.launch.launch`).
        n_initial: the size of the original group. extra_data: how a shrink redistributed data
            (see :meth:`WorkerContext.shard`). violations: accepted requirement violations
            (``strict=False``). assumption_violated: recorded in every step record.
        data_sizes: examples of every worker id's original data (for the shrink record; optional).

    Raises:
        ConfigError: ``n < 1``, identities of the wrong length or not distinct, Byzantine ids that
            are not workers, every worker Byzantine, ``settings.processes`` above ``n``, or a
            ``settings.membership`` schedule naming a worker id ``>= n`` or leaving nobody.
            A fault's ``join_step`` at or after the last step (``settings.steps``).
        AssumptionError: ``settings.membership`` leaves, at some step, fewer workers than the strict
            rule's requirement needs.
    """

    build: Callable[["WorkerContext"], WorkerParts]
    n: int
    run_dir: str
    settings: RunSettings = field(default_factory=RunSettings)
    f: int = 0
    rule: Optional[Aggregator] = None
    byzantine_ids: tuple[int, ...] = ()
    identities: tuple[int, ...] = ()
    fingerprint: dict[str, Any] = field(default_factory=dict)
    faults: list["Fault"] = field(default_factory=list)
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    n_initial: int = 0
    extra_data: dict[int, list[tuple[tuple[int, ...], int, int]]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    assumption_violated: bool = False
    data_sizes: dict[int, int] = field(default_factory=dict)

    def shard_sizes(self) -> list[int]:
        """Examples held by every current rank (from ``data_sizes`` and ``extra_data``; ``[]`` if unknown)."""
        if not self.data_sizes:
            return []

        def size(w: int) -> int:
            own = int(self.data_sizes.get(w, 0))
            for lost, i, k in self.extra_data.get(w, []):
                pool = sum(size(v) for v in lost)
                own += len(range(i, pool, k))
            return own

        return [size(w) for w in self.identities]

    def __post_init__(self) -> None:
        self.n = int(self.n)
        if self.n < 1:
            raise ConfigError(f"n must be >= 1 worker; got {self.n}.")
        self.identities = tuple(int(i) for i in self.identities) or tuple(range(self.n))
        if len(self.identities) != self.n or len(set(self.identities)) != self.n:
            raise ConfigError(f"identities must give {self.n} distinct worker ids; got {list(self.identities)}.")
        self.byzantine_ids = tuple(sorted(int(b) for b in self.byzantine_ids))
        if any(b not in self.identities for b in self.byzantine_ids):
            raise ConfigError(f"byzantine_ids {list(self.byzantine_ids)} must be worker ids among "
                              f"{list(self.identities)}.")
        if len(self.byzantine_ids) >= self.n:
            raise ConfigError(f"at least one worker must be honest; got {len(self.byzantine_ids)} Byzantine of "
                              f"n={self.n}.")
        self.n_initial = int(self.n_initial or self.n)
        self.processes()  # refuse trainer.processes > n in either mode, not only when processes start
        if self.settings.membership:  # worker ids and "one must remain" need n: checked here, before launch
            self._check_schedule()
        self.aggregator_requirement()  # no trusted aggregator: r_a against f_a, before any process starts
        s = self.settings
        if int(s.shard_redundancy) != 1 or int(s.shard_parity) != 0:  # k and g against the world, before launch
            from ..training.shard_protection import check_protection

            check_protection(self.n, int(s.shard_redundancy), int(s.shard_parity),
                             key={"k": s.key("shard_redundancy"), "g": s.key("shard_parity")})
        for fault in self.faults:  # a grow boundary the run never reaches: the replacement would never join
            if int(fault.join_step) >= int(self.settings.steps) > 0:
                raise ConfigError(f"fault {fault.id}: join_step={fault.join_step} is not before the run's last step "
                                  f"({self.settings.key('steps')}={self.settings.steps}): the run ends before that "
                                  f"boundary; use a join_step below {self.settings.steps}, or 0 (whenever it is ready).")

    def _check_schedule(self) -> None:
        """The membership schedule against n and the rule: every size it passes through must meet the
        rule's requirement (a strict rule refuses it here, not after the steps before the change ran)."""
        from .schedule import parse_membership, sizes

        key = self.settings.key("membership")
        sched = parse_membership(self.settings.membership, key=key, n=self.n_initial)
        for step, size in sizes(sched, self.n_initial).items():
            try:
                self.check_rule(size)
            except AssumptionError as exc:
                raise AssumptionError(f"{key} leaves {size} of the n={self.n_initial} workers from step {step} on: "
                                      f"{exc} Change the schedule (or the rule) so every step keeps enough "
                                      "workers.") from None

    def processes(self) -> int:
        """OS processes of the ``processes`` mode (``settings.processes``, or one per worker).

        Raises:
            ConfigError: more processes than workers.
        """
        p = int(self.settings.processes) or self.n
        if p > self.n:
            raise ConfigError(f"trainer.processes={p} exceeds the n={self.n} workers; every process hosts at "
                              f"least one worker. Use trainer.processes in [1, {self.n}] (0: one per worker).")
        return p

    def hosts(self) -> Optional[tuple[int, ...]]:
        """The process of every worker rank when processes host several workers (``None``: one each)."""
        from ..distributed.comm import block_hosts

        p = self.processes()
        return None if p == self.n else block_hosts(self.n, p)

    @property
    def byzantine_ranks(self) -> tuple[int, ...]:
        """The current ranks of the Byzantine workers."""
        return tuple(r for r, w in enumerate(self.identities) if w in self.byzantine_ids)

    @property
    def ckpt_dir(self) -> str:
        """The checkpoint folder (``settings.ckpt_dir`` or ``<run_dir>/checkpoints``)."""
        import os

        return self.settings.ckpt_dir or os.path.join(self.run_dir, "checkpoints")

    def aggregator_requirement(self) -> dict[str, Any]:
        """Check the cross-check of the aggregate against the declared lying aggregators (before launch).

        The replicas ``r_a`` of every slice: ``settings.aggregator_replicas`` where the reduction
        shards (``sharded``, or ``auto`` with a rule that shards), else every rank (gather: ``n``
        replicas of the whole aggregate). The requirement (:func:`~robustagg.distributed.vote.aggregator_requirement`)
        is ``r_a >= 2 f_a + 1`` under ``vote`` and ``r_a >= f_a + 1`` under ``abort``.

        Returns:
            the summary's ``aggregator_check`` block: ``replicas``, ``lying_aggregators``,
            ``on_aggregate_mismatch``, ``on_lying_aggregator``, ``requirement``, ``holds``.

        Raises:
            ConfigError: replicas above ``n``; replicas, a vote, an exclusion or an ``aggregator_lie``
                fault where processes host several workers (the cross-check compares processes);
                replicas with a rule that cannot be replicated
                (:func:`~robustagg.distributed.sharded.supports_replication`: no sharded
                implementation, or Bucketing in front).
            AssumptionError: the requirement fails and the rule is strict (``strict=false``:
                warned about and recorded in :attr:`violations`).
        """
        from ..distributed.sharded import supports_replication, supports_sharding
        from ..distributed.vote import aggregator_requirement

        s = self.settings
        r, fa, policy = int(s.aggregator_replicas), int(s.lying_aggregators), str(s.on_aggregate_mismatch)
        lies = [f for f in self.faults if f.kind == "aggregator_lie"]
        if r > self.n:
            raise ConfigError(f"{s.key('aggregator_replicas')}={r} exceeds the n={self.n} ranks: no two replicas of a "
                              f"slice may share a rank; use a value in [1, {self.n}].")
        checked = r > 1 or policy == "vote" or s.on_lying_aggregator == "exclude" or lies
        if checked and s.mode == "processes" and self.hosts() is not None:
            raise ConfigError(f"the aggregate cross-check ({s.key('aggregator_replicas')}, {s.key('on_aggregate_mismatch')}"
                              f", aggregator_lie faults) compares processes, one worker each: set "
                              f"{s.key('processes')}=0.")
        if r > 1 and self.rule is not None and not supports_replication(self.rule):
            raise ConfigError(f"{s.key('aggregator_replicas')}={r} cannot replicate {type(self.rule).__name__}: "
                              f"{'Bucketing draws its permutation once per call, so the replicas of a slice would see different buckets' if supports_sharding(self.rule) else 'it has no sharded implementation'}. "
                              f"Use {s.key('reduction')}=gather with {s.key('on_aggregate_mismatch')}=vote.")
        sharded = s.reduction == "sharded" or (s.reduction == "auto" and self.rule is not None
                                               and supports_sharding(self.rule))
        replicas = r if sharded else self.n
        text, holds = aggregator_requirement(replicas, fa, policy)
        block = {"replicas": replicas, "lying_aggregators": fa, "on_aggregate_mismatch": policy,
                 "on_lying_aggregator": str(s.on_lying_aggregator), "requirement": text, "holds": holds}
        if not holds and fa > 0:
            msg = (f"aggregate cross-check requires {text}: {fa} lying aggregator rank(s) can "
                   f"{'win a slice vote' if policy == 'vote' else 'go undetected'}. Raise "
                   f"{s.key('aggregator_replicas')}, lower {s.key('lying_aggregators')}, or pass strict=False.")
            if self.rule is None or getattr(self.rule, "strict", True):
                raise AssumptionError(msg)
            warnings.warn(msg, AssumptionWarning, stacklevel=2)
            if msg not in self.violations:
                self.violations.append(msg)
        return block

    def check_rule(self, n: Optional[int] = None) -> list[str]:
        """The rule's requirement at ``n`` workers (default: this job's); violations allowed by ``strict=False``.

        Raises:
            AssumptionError: the requirement fails and the rule is strict.
        """
        if self.rule is None:
            return []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AssumptionWarning)
            return list(self.rule.check(self.n if n is None else int(n)))


@dataclass
class WorkerContext:
    """What ``Job.build`` is told in a worker process.

    Attributes:
        job: the job (its current membership). rank: this process's rank (0 in simulated mode).
        local_ranks: the ranks this process hosts. device: where to put the model and data.
        comm: the communicator (for advanced builds; most only need the above).
    """

    job: Job
    rank: int
    local_ranks: tuple[int, ...]
    device: torch.device
    comm: Optional["Communicator"] = None

    @property
    def n(self) -> int:
        """Current number of workers."""
        return self.job.n

    @property
    def byzantine_ranks(self) -> tuple[int, ...]:
        """Current ranks of the Byzantine workers (for :class:`~robustagg.training.ByzantineBehaviour`)."""
        return self.job.byzantine_ranks

    @property
    def seed(self) -> int:
        """The run's seed."""
        return int(self.job.settings.seed)

    def worker_id(self, rank: int) -> int:
        """The worker id of ``rank``."""
        return self.job.identities[rank]

    def shard(self, rank: int, data_of: Callable[[int], "Shard"]) -> "Shard":
        """Worker ``rank``'s training data: ``data_of(worker id)``, plus what a shrink redistributed to it.

        With ``shrink_shards="redistribute"``, the lost workers' data (concatenated in rank order)
        is dealt round-robin to the survivors: survivor ``i`` of ``n'`` gets rows ``i::n'``.

        Args:
            rank: a hosted rank. data_of: the original data of a worker id.
        """
        from ..training.trainer import Shard

        def of(wid: int) -> Shard:
            s = data_of(wid)
            for lost, i, k in self.job.extra_data.get(wid, []):
                pool = [of(w) for w in lost]
                x = torch.cat([p.x for p in pool])[i::k]
                y = torch.cat([p.y for p in pool])[i::k]
                s = Shard(torch.cat([s.x, x.to(s.x.dtype)]), torch.cat([s.y, y]))
            return s

        return of(self.worker_id(rank))


def shrink_job(job: Job, lost: Sequence[int], *, reason: str = "") -> tuple[Job, dict[str, Any]]:
    """The job that continues ``job`` without the workers ``lost`` (worker ids), and its lineage record.

    Normalisation follows the survivors (the rule receives ``n' = n - len(lost)`` rows: the mean of
    the n' survivors, not their sum over the old n); the effective batch becomes ``n' x batch``;
    the learning rate is left as configured (recorded). The lost workers' data is dropped, or dealt
    round-robin to the survivors (``settings.shrink_shards``). Byzantine workers among the lost are
    gone; the survivors keep their roles and worker ids. The fingerprint is the original experiment's.

    Raises:
        AssumptionError: the rule's requirement fails for n' (strict rules): the run stops.
        ConfigError: no honest worker would be left.
    """
    lost_set = {int(w) for w in lost}
    survivors = tuple(w for w in job.identities if w not in lost_set)
    old_n, new_n = job.n, len(survivors)
    byz = tuple(w for w in job.byzantine_ids if w in survivors)
    if len(byz) >= new_n:
        raise ConfigError(f"cannot continue after losing worker(s) {sorted(lost_set)}: no honest worker is left "
                          f"among the {new_n} survivors.")
    try:
        violations = job.check_rule(new_n)
    except AssumptionError as exc:
        raise AssumptionError(f"{exc} Cannot shrink from n={old_n} to the n={new_n} surviving workers after "
                              f"losing worker(s) {sorted(lost_set)}; the run stops.") from None
    extra = {w: list(v) for w, v in job.extra_data.items()}  # lost workers' received data travels on
    policy = job.settings.shrink_shards
    gone = tuple(w for w in job.identities if w in lost_set)
    if policy == "redistribute" and gone:
        for i, w in enumerate(survivors):
            extra.setdefault(w, []).append((gone, i, new_n))
    settings = job.settings  # trainer.processes=n means one process per worker: it stays that after a shrink
    if int(settings.processes) == old_n:
        settings = dataclasses.replace(settings, processes=0)
    protection = _protection_after(settings, new_n)
    if protection is not None:
        settings = dataclasses.replace(settings, shard_redundancy=protection["k"], shard_parity=protection["g"])
    new = dataclasses.replace(job, n=new_n, identities=survivors, byzantine_ids=byz, extra_data=extra,
                              settings=settings, violations=job.violations + list(violations),
                              assumption_violated=job.assumption_violated or bool(violations))
    b = int(job.settings.batch_size)
    record = {"event": "shrink", "old_n": old_n, "new_n": new_n, "lost_workers": sorted(lost_set),
              "survivors": list(survivors), "byzantine_ranks": list(new.byzantine_ranks), "shards": policy,
              "normalisation": f"mean over the {new_n} survivors", "effective_batch": [old_n * b, new_n * b],
              "lr_rule": "unchanged", "violations": list(violations), "reason": reason,
              "shard_sizes": new.shard_sizes()}
    if protection is not None:
        record["shard_protection"] = protection
    return new, record


def _protection_after(settings: RunSettings, n: int) -> Optional[dict[str, Any]]:
    """The shard redundancy and parity the n survivors can keep (``None``: neither is on).

    ``k`` becomes ``min(k, n)``; a parity group size that leaves fewer than two groups is turned
    off (its parity would have to live inside its own group). ``note`` says what changed."""
    k, g = int(settings.shard_redundancy), int(settings.shard_parity)
    if k == 1 and g == 0:
        return None
    k2 = min(k, n)
    g2 = g if g and -(-n // g) >= 2 else 0
    note = "unchanged" if (k2, g2) == (k, g) else (
        f"shard_redundancy {k} -> {k2}" if k2 != k else f"shard_parity {g} -> off: {n} slices make one group of {g}")
    return {"k": k2, "g": g2, "note": note}


def grow_job(job: Job, joined: Sequence[int], *, byzantine: Sequence[int] = (), reason: str = ""
             ) -> tuple[Job, dict[str, Any]]:
    """The job that continues ``job`` with the workers ``joined`` (worker ids) back, and its lineage record.

    The inverse of :func:`shrink_job`: the members become the sorted union (ranks in worker-id
    order), the rule receives ``n' = n + len(joined)`` rows (the mean over the n' members), the
    effective batch becomes ``n' x batch``, the learning rate is left as configured, and the rule's
    requirement is re-checked for n'. A joiner keeps its original role (``byzantine``: the joiners
    that were Byzantine) and its own data (a shrink that redistributed data is not reversed: refused).

    Raises:
        ConfigError: a joiner is already a member, or the lost workers' data was redistributed
            (``shrink_shards="redistribute"``).
        AssumptionError: the rule's requirement fails for n' (strict rules).
    """
    add = sorted({int(w) for w in joined})
    already = [w for w in add if w in job.identities]
    if already:
        raise ConfigError(f"cannot grow: worker(s) {already} are already members {list(job.identities)}.")
    if job.extra_data:
        raise ConfigError("cannot rejoin after trainer.shrink_shards=redistribute dealt the lost workers' data to the "
                          "survivors; use trainer.shrink_shards=drop with trainer.rejoin=true.")
    members = tuple(sorted(set(job.identities) | set(add)))
    old_n, new_n = job.n, len(members)
    violations = job.check_rule(new_n)
    byz = tuple(sorted(set(job.byzantine_ids) | {int(w) for w in byzantine if int(w) in add}))
    new = dataclasses.replace(job, n=new_n, identities=members, byzantine_ids=byz,
                              violations=job.violations + list(violations),
                              assumption_violated=job.assumption_violated or bool(violations))
    b = int(job.settings.batch_size)
    record = {"event": "grow", "old_n": old_n, "new_n": new_n, "joined": add, "members": list(members),
              "byzantine_ranks": list(new.byzantine_ranks), "normalisation": f"mean over the {new_n} members",
              "effective_batch": [old_n * b, new_n * b], "lr_rule": "unchanged", "violations": list(violations),
              "reason": reason}
    return new, record
