"""Structured-config schemas of ``conf/`` (registered in Hydra's ConfigStore as ``train_schema``).

A numeric key's range is declared on its field (:func:`robustagg.limits.limit` metadata: type,
range, meaning) and checked before launch by :func:`experiments.wiring.settings_problems`; the
``trainer`` keys that :class:`robustagg.launch.RunSettings` defines take their ranges from there.
Every typed node refuses keys it does not declare, so a misspelt key (``trainer.setps=10``) is an
error at composition, never silently ignored; a key added with ``+`` (``+trainer.optimizer=adam``),
which Hydra lets into the composed config, is refused by :func:`experiments.wiring.as_config`.
Open on purpose: the ``aggregator``, ``preaggregation`` and ``attack`` nodes carry a ``_target_``
and the class's own parameters, checked against the class's signature by
:func:`experiments.wiring.validate` before any process starts; ``model``, ``optimizer`` and
``scheduler`` are ``_target_`` nodes too (any ``nn.Module``, ``torch.optim`` optimizer or scheduler;
:mod:`experiments.models`, :mod:`experiments.optim`); each ``trainer.callbacks`` entry takes what its
class takes; ``faults`` holds one named entry per selected file, each checked against
:class:`FaultConf`.

``n`` and the declared ``f`` are set once, in ``threat``, and interpolated everywhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from robustagg.limits import limit

__all__ = ["Mode", "Partition", "DataName", "ByzantineData", "ThreatConf", "DataConf", "ModelConf", "CheckpointConf",
           "TrainerConf", "FaultConf", "OptimizerLimits", "LoggerConf", "TrainConfig", "register_configs",
           "check_group_choices", "check_setting_keys", "check_command_line", "moved_settings", "DATA_KEYS",
           "logged_config", "partition_label"]


class Mode(str, enum.Enum):
    """``processes``: one OS process per worker over torch.distributed; ``simulated``: all in one."""

    processes = "processes"
    simulated = "simulated"


class Partition(str, enum.Enum):
    """How the training set is split among workers (see :func:`robustagg.data.partition`)."""

    iid = "iid"
    dirichlet = "dirichlet"
    label_sorted = "label_sorted"
    long_tail = "long_tail"
    natural = "natural"


class DataName(str, enum.Enum):
    """Data sets: bundled (``digits``, ``synthetic``), read from their published files under
    ``data.root`` (``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``), a Hugging Face data
    set (``hf``), or your own builder (``custom``, with ``data._target_``)."""

    digits = "digits"
    synthetic = "synthetic"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    hf = "hf"
    custom = "custom"


class ByzantineData(enum.Enum):
    """``partition``: Byzantine workers get a share like everyone; ``full``: the partition is over
    the honest workers only and each Byzantine worker draws from the whole training set."""

    partition = "partition"
    full = "full"


@dataclass
class ThreatConf:
    """Who is Byzantine.

    Attributes:
        n: number of workers (processes).
        f: the *declared* Byzantine bound every rule is configured for.
        byzantine: how many workers actually attack (default ``f``); more than ``f`` needs
            ``strict=false``.
        ranks: explicit Byzantine ranks (default: the last ``byzantine`` ranks, so rank 0, which
            logs, is honest).
        start_step: the Byzantine workers behave honestly before this step.
    """

    n: int = 10
    f: int = 2
    byzantine: int = II(".f")
    ranks: Optional[List[int]] = None
    start_step: int = field(default=0, metadata=limit(0, None, "the step the Byzantine workers start attacking at",
                                                      integer=True))


@dataclass
class DataConf:
    """Data set and partition.

    Attributes:
        name: ``digits`` (scikit-learn's 8x8 handwritten digits, bundled) or ``synthetic``.
        partition: ``iid``, ``dirichlet`` (per-class Dirichlet(alpha) shares), ``label_sorted``
            (sorted by label, cut into ``shards_per_worker`` shards per worker), ``long_tail``
            (class frequencies decay geometrically to 1/imbalance, then split iid).
        alpha: Dirichlet concentration (smaller = more heterogeneous).
        shards_per_worker: label_sorted shards per worker.
        imbalance: long_tail ratio between the most and the least frequent class.
        min_samples: dirichlet: redraw until every worker has at least this many examples.
        max_tries: dirichlet: redraws before giving up with an error.
        byzantine_data: see :class:`ByzantineData`.
        test_fraction: share of each class held out for evaluation.
        max_train_samples: keep only this many training examples (``null``: all).
        dim, num_classes, samples, separation, heterogeneity: synthetic only: input dimension,
            classes, total examples, distance of class means from the origin, and the norm of a
            per-worker shift of the training inputs (feature heterogeneity).
        root: the folder holding the published files of ``mnist``, ``fashion_mnist``, ``cifar10``
            and ``cifar100`` (or the folders other tools leave there; see
            :func:`robustagg.data.load`). download: fetch and verify missing files.
        augment: random crop + horizontal flip per worker (``null``: the data set's default, on
            for CIFAR, off otherwise; :data:`robustagg.data.DEFAULT_AUGMENT`).
        max_test_samples: evaluate on the first this many test examples (``null``: all).
        label: CIFAR-100: ``fine`` (100 classes) or ``coarse`` (20).
        path, hf_name, image_key, label_key, partition_key: ``data=hf``: the Hugging Face data set,
            its configuration name, the input and label columns, and the column of each example's
            natural group (for ``partition=natural``: one group per worker, round-robin).
        _target_: ``data=custom``: your builder ``my.module.build``, called with ``args``, returning
            what :func:`robustagg.data.from_user` accepts (tensors or torch Datasets).
    """

    name: DataName = DataName.digits
    partition: Partition = Partition.iid
    alpha: float = field(default=0.5, metadata=limit(0, None, "the Dirichlet concentration", low_open=True))
    shards_per_worker: int = field(default=2, metadata=limit(1, None, "label_sorted shards per worker", integer=True))
    imbalance: float = field(default=10.0, metadata=limit(1, None, "long_tail ratio of the class frequencies"))
    min_samples: int = field(default=1, metadata=limit(0, None, "examples every worker needs", integer=True))
    max_tries: int = field(default=100, metadata=limit(1, None, "dirichlet redraws", integer=True))
    byzantine_data: ByzantineData = ByzantineData.partition
    test_fraction: float = field(default=0.25, metadata=limit(0, 1, "share of each class held out", low_open=True,
                                                              high_open=True))
    max_train_samples: Optional[int] = field(default=None, metadata=limit(
        1, None, "training examples kept, null = all", integer=True, optional=True, example=1000))
    dim: int = field(default=20, metadata=limit(1, None, "synthetic input dimension", integer=True))
    num_classes: int = field(default=10, metadata=limit(2, None, "synthetic classes", integer=True))
    samples: int = field(default=4000, metadata=limit(1, None, "synthetic examples", integer=True))
    separation: float = field(default=3.0, metadata=limit(0, None, "distance of the synthetic class means"))
    heterogeneity: float = field(default=0.0, metadata=limit(0, None, "norm of each worker's synthetic input shift"))
    root: Optional[str] = None
    download: bool = False
    augment: Optional[bool] = None
    max_test_samples: Optional[int] = field(default=None, metadata=limit(
        1, None, "test examples evaluated, null = all", integer=True, optional=True, example=1000))
    label: str = "fine"
    path: Optional[str] = None
    hf_name: Optional[str] = None
    image_key: str = "image"
    label_key: str = "label"
    partition_key: Optional[str] = None
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)


#: The ``data`` keys every data set reads (the split, the partition and the sample limits).
_DATA_COMMON = ("name", "partition", "alpha", "shards_per_worker", "imbalance", "min_samples", "max_tries",
                "byzantine_data", "test_fraction", "max_train_samples", "max_test_samples", "augment")
_FILES = ("root", "download")
#: Per data set, the :class:`DataConf` keys it reads (what :func:`experiments.data.build_data` uses):
#: the common keys, then its own. The logged config keeps only these (:func:`logged_config`).
DATA_KEYS: Dict[str, tuple[str, ...]] = {
    "digits": _DATA_COMMON,
    "synthetic": _DATA_COMMON + ("dim", "num_classes", "samples", "separation", "heterogeneity"),
    "mnist": _DATA_COMMON + _FILES, "fashion_mnist": _DATA_COMMON + _FILES, "cifar10": _DATA_COMMON + _FILES,
    "cifar100": _DATA_COMMON + _FILES + ("label",),
    "hf": _DATA_COMMON + ("root", "path", "hf_name", "image_key", "label_key", "partition_key"),
    "custom": _DATA_COMMON + ("_target_", "args"),
}


def logged_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``cfg`` (a resolved config as plain dicts) with only the chosen data set's ``data`` keys
    (:data:`DATA_KEYS`): what W&B stores as the run's config. An unknown data set keeps every key.

    Example:
        >>> sorted(logged_config({"data": {"name": "digits", "partition": "iid", "samples": 4000}})["data"])
        ['name', 'partition']
    """
    data = cfg.get("data")
    if not isinstance(data, dict):
        return dict(cfg)
    name = getattr(data.get("name"), "value", data.get("name"))
    keep = DATA_KEYS.get(str(name))
    if keep is None:
        return dict(cfg)
    return {**cfg, "data": {k: v for k, v in data.items() if k in keep}}


def partition_label(data: Any) -> str:
    """Short label of how the data is split: ``iid``, ``dirichlet(a=0.1)``, ``label_sorted(2 shards)``,
    ``long_tail(x10)``; synthetic feature shift appends ``+shift=h``. ``data``: the ``data`` node
    (a mapping).

    Example:
        >>> partition_label({"partition": "dirichlet", "alpha": 0.1})
        'dirichlet(a=0.1)'
    """
    import math

    def value(key: str, default: Any = None) -> Any:
        v = data.get(key, default)
        return getattr(v, "value", v)

    part = str(value("partition", "iid"))
    if part == "dirichlet":
        label = f"dirichlet(a={float(value('alpha', math.nan)):g})"
    elif part == "label_sorted":
        label = f"label_sorted({value('shards_per_worker', '?')} shards)"
    elif part == "long_tail":
        label = f"long_tail(x{float(value('imbalance', math.nan)):g})"
    else:
        label = part
    het = value("heterogeneity")
    if value("name") == "synthetic" and isinstance(het, (int, float)) and het > 0:
        label += f"+shift={het:g}"
    return label


@dataclass
class ModelConf:
    """Former fixed model schema (``name``, ``hidden``, ``channels``, ``dropout``), kept for
    imports: ``model`` is now a ``_target_`` node (``conf/model/``; any ``nn.Module``), built by
    :func:`experiments.models.instantiate_model`."""

    name: str = "mlp"
    hidden: List[int] = field(default_factory=lambda: [64])
    channels: List[int] = field(default_factory=lambda: [8, 16])
    dropout: float = 0.0


@dataclass
class CheckpointConf:
    """Committed checkpoints (see ``docs/howto/resume.md``).

    Attributes:
        every: write a committed checkpoint after every K steps and at the end (0: none).
        dir: the checkpoint folder, shared by every rank (``null``: ``<run dir>/checkpoints``).
            It also holds ``lineage.jsonl`` and the fired-faults log ``faults.jsonl``.
        keep: committed checkpoints kept (older ones are pruned after a newer one commits).
    """

    every: int = 0
    dir: Optional[str] = None
    keep: int = 3


@dataclass
class TrainerConf:
    """The training loop and its transport.

    Attributes:
        mode: ``processes`` or ``simulated``.
        steps: optimizer steps. batch_size: per worker per step.
        lr, momentum, weight_decay, nesterov, scheduler: moved to the ``optimizer`` and
            ``scheduler`` groups (``optimizer.lr=0.05``, ``scheduler=cosine``); setting one here
            is refused with a message naming the new key.
        worker_momentum: beta of each worker's momentum (0 = off).
        eval_every: evaluate on the test set every K steps, at step 0 and at the end (0: only at the end).
        param_check_every: compare a parameter digest across ranks every K steps (and at the end).
        reduction: the robust reduction mode: ``auto`` (``sharded`` where the rule supports it, else
            ``gather``), ``gather`` or ``sharded``.
        on_nonfinite: ``abort`` or ``drop`` a non-finite submission.
        backend: ``auto`` (gloo on CPU, nccl on CUDA), ``gloo`` or ``nccl``.
        device: ``auto``, ``cpu`` or ``cuda``.
        threads: torch threads per process.
        start_method: multiprocessing start method of the spawned workers: ``auto`` (``fork`` on
            Linux with CPU training, the fastest start; ``spawn`` otherwise), ``spawn``,
            ``forkserver`` or ``fork``.
        collective_timeout_s: how long a collective waits for the others before failing.
        master_addr: rendezvous host of spawned workers. port: 0 picks a free port.
        progress: show a progress bar. metrics: compute ``agg/*`` metrics each step.
        callbacks: ``_target_`` nodes instantiated in every worker process; each instance is
            called as ``cb(trainer, step_output)`` after every step on every rank (custom logging,
            fault injection in tests).
        checkpoint: see :class:`CheckpointConf`.
        resume: ``auto`` (continue from the newest committed checkpoint in ``checkpoint.dir`` that
            verifies, if any), ``never`` (start fresh; refused when the folder already holds
            checkpoints), or the path of one checkpoint folder.
        resume_changes: ``refuse`` (default) a resume whose experiment fingerprint differs from
            the checkpoint's (the message lists every differing key), or ``allow`` it: the run
            continues the changed experiment and the change is recorded in ``lineage.jsonl``.
        max_restarts: how often the app's launcher restarts the worker group after a failure
            (each restart restores the newest committed checkpoint). Under torchrun, torchrun's
            ``--max-restarts`` is used instead.
        on_failure: ``restart`` (the same n workers) or ``shrink`` (continue without the lost
            workers if the rule's requirement still holds for the survivors and the declared f).
        shrink_shards: after a shrink, the lost workers' data is ``drop``-ped or
            ``redistribute``-d round-robin over the survivors.
        straggler_factor: a rank whose compute time exceeds this many times the step's median
            (and 50 ms) is reported as a straggler.
        processes: in ``processes`` mode, how many OS processes host the n workers (0: one per
            worker; P: contiguous blocks of about n/P workers each, e.g. 100 clients on 4).
        measure_bias: compute ``agg/bias_vs_sync`` every update (the protocol's synchronous
            full-participation honest mean on the same parameters; extra computation, evaluated
            where the main process hosts every worker, i.e. simulated mode).
        precision: the workers' forward pass and loss: ``32`` (float32), ``bf16`` (bfloat16
            autocast, CPU or CUDA) or ``fp16`` (float16 autocast with a per-worker loss scaler,
            CUDA only). Submissions, aggregation and the optimizer stay float32
            (:mod:`robustagg.training.precision`).
        batched_gradients: ``auto`` (default), ``true`` or ``false``: compute each process's
            workers' gradients of an update in one ``torch.func.vmap`` call (``protocol=dsgd`` or
            ``async``, ``precision=32``, a model without BatchNorm, dropout or random augmentation,
            and a dry run on two examples that passes). ``auto`` turns it on exactly where those
            checks pass and keeps a resumed checkpoint's value, ``true`` refuses a run that fails
            them, ``false`` is the per-worker loop; decided before launch
            (:func:`robustagg.training.batched.resolve_batched`). Not bit-identical to the loop in
            general (the digits MLP was; convolutional models differ by a few float32 ulps per
            step: :mod:`robustagg.training.batched`), so the resolved ``true``/``false`` is part
            of the run's identity.
        rejoin: with ``on_failure=shrink``: a replacement for every lost worker id joins the
            running group at a step boundary with the state of a live peer (the app's launcher).
        peer_copy: with ``rejoin``: survivors keep the lost workers' last committed own state in
            memory (ring: worker i holds the absent workers after it); a replacement uses it when
            its disk copy is older or missing (SHA-256 checked against the committed manifests).
        membership: simulated mode: absences ``[{workers: [ids], absent: [a, b]}]`` (absent in the
            1-based steps a..b-1; b = 0: for good), the reference run of a shrink and a rejoin.
        aggregator_replicas, lying_aggregators, on_aggregate_mismatch, on_lying_aggregator: no
            trusted aggregator (:mod:`robustagg.distributed.vote`): ``r_a`` ranks compute each
            coordinate slice (``reduction=sharded``), ``f_a`` the declared
            lying aggregator ranks (``r_a >= 2 f_a + 1`` under ``vote``), ``abort`` or ``vote`` on a
            disagreement, ``continue`` with or ``exclude`` a named rank (needs ``on_failure=shrink``).
        state_sharding: ``none`` or ``optimizer`` (each process owns its slice's optimizer state,
            :mod:`robustagg.training.state_sharding`; processes mode, ``reduction=sharded``).
        shard_redundancy, shard_parity: a second source of each slice's state for the survivors of
            a shrink: ``k`` holders per slice, or an XOR parity per group of ``g`` slices
            (:mod:`robustagg.training.shard_recovery`).
    """

    mode: Mode = Mode.processes
    steps: int = 300
    batch_size: int = 32
    # Moved to the optimizer and scheduler groups: kept only so that setting one fails with the
    # migration message of experiments.optim.moved_keys instead of "key not in TrainerConf"; the
    # metadata names the new key (experiments.optim.MOVED_KEYS), and no suggestion names these.
    lr: Any = field(default=None, metadata={"moved_to": "optimizer.lr"})
    momentum: Any = field(default=None, metadata={"moved_to": "optimizer.momentum"})
    weight_decay: Any = field(default=None, metadata={"moved_to": "optimizer.weight_decay"})
    nesterov: Any = field(default=None, metadata={"moved_to": "optimizer.nesterov"})
    scheduler: Any = field(default=None, metadata={"moved_to": "scheduler=NAME (none | cosine | warmup_cosine | "
                                                                "multistep)"})
    worker_momentum: float = 0.0
    eval_every: int = 25
    param_check_every: int = 100
    reduction: str = "auto"
    on_nonfinite: str = "abort"
    backend: str = "auto"
    device: str = "auto"
    threads: int = 1
    start_method: str = "auto"
    collective_timeout_s: float = 60.0
    master_addr: str = "127.0.0.1"
    port: int = 0
    progress: bool = True
    metrics: bool = True
    callbacks: List[Any] = field(default_factory=list)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    resume: str = "auto"
    resume_changes: str = "refuse"
    max_restarts: int = 0
    on_failure: str = "restart"
    shrink_shards: str = "drop"
    straggler_factor: float = 10.0
    processes: int = 0
    measure_bias: bool = False
    precision: str = "32"
    batched_gradients: Any = "auto"  # auto | true | false (experiments.wiring checks the value)
    rejoin: bool = False
    peer_copy: bool = False
    membership: List[Any] = field(default_factory=list)
    aggregator_replicas: int = 1
    lying_aggregators: int = 0
    on_aggregate_mismatch: str = "abort"
    on_lying_aggregator: str = "continue"
    state_sharding: str = "none"
    shard_redundancy: int = 1
    shard_parity: int = 0


@dataclass
class FaultConf:
    """One injected fault (``conf/faults/``; see :class:`robustagg.training.Fault`).

    Attributes:
        kind: ``crash``, ``hang``, ``desync``, ``corrupt``, ``nan``, ``compute_corrupt``, ``common_mode``, ``aggregator_lie``,
            ``checkpoint_crash``, ``checkpoint_corrupt``, ``partition`` or ``rejoin``.
        rank: the worker it hits. step: the 1-based step (checkpoint kinds: the checkpoint's step).
        where, how: ``crash``: ``before_step``/``after_reduce``/``after_step``; ``sigkill``/``exit``;
            ``aggregator_lie``: how it lies, ``scale``/``sign_flip``/``stale``/``last_bits``.
        seconds: ``hang``; ``rejoin``: after how long the replacement comes back.
        mode: ``desync`` (``skip``/``reorder``). bits: ``corrupt``.
        phase: ``checkpoint_crash`` (``files``/``commit``). file: ``checkpoint_corrupt``.
        workers: ``partition``: the worker ids cut off from the others (needs
            ``trainer.on_failure=shrink``: the side with a strict majority continues).
        join_step: ``rejoin``: the survivors admit the replacement exactly after this step (0:
            whenever it is ready).
    """

    kind: str = MISSING
    rank: int = 0
    step: int = 1
    where: str = "before_step"
    how: str = "sigkill"
    seconds: float = 1.0
    mode: str = "skip"
    bits: int = 1
    phase: str = "files"
    file: str = ""
    workers: List[int] = field(default_factory=list)
    join_step: int = 0


@dataclass
class OptimizerLimits:
    """The ranges of the ``optimizer`` node's common hyperparameters (the node itself is open: any
    ``torch.optim`` optimizer's keyword arguments; a key the chosen optimizer does not take is
    refused when it is built). Checked before launch by :func:`experiments.wiring.settings_problems`.

    Attributes:
        lr: the server step size. momentum: SGD's (or RMSprop's) momentum beta: 1 and above make
            the iterates diverge. weight_decay: the L2 penalty. dampening: SGD's momentum dampening.
        eps: the term added for numerical stability (Adam, RMSprop, ...).
    """

    lr: float = field(default=0.1, metadata=limit(0, None, "the server step size", low_open=True))
    momentum: float = field(default=0.0, metadata=limit(0, 1, "the momentum beta, 0 = off", high_open=True))
    weight_decay: float = field(default=0.0, metadata=limit(0, None, "the L2 penalty"))
    dampening: float = field(default=0.0, metadata=limit(0, 1, "the momentum dampening"))
    eps: float = field(default=1e-8, metadata=limit(0, None, "the stability term", low_open=True))


@dataclass
class LoggerConf:
    """``wandb`` (rank 0 only; ``mode`` offline by default, so no network is needed) or ``none``."""

    name: str = "none"
    project: str = "robustagg"
    entity: Optional[str] = None
    mode: str = "offline"
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class ServerConf:
    """What the server holds besides the model.

    Attributes:
        root_samples: size of the server's clean root data set (FLTrust, Cao et al., NDSS 2021):
            that many training examples drawn uniformly (``seed``) from the training pool, with
            their true labels. 0 (default): none. Every process holds the same set and computes
            the same root gradient each step; the rule is handed it (``set_trusted``).
    """

    root_samples: int = 0


@dataclass
class TrainConfig:
    """The whole configuration of ``python -m experiments.train``.

    Attributes:
        seed: every random choice (data split, partition, init, batches, attack noise) derives from it;
            an integer in ``[0, 2**63)``, checked by :func:`experiments.wiring.as_config` (typed
            ``Any`` so that ``seed=1e20`` reaches that check and its message).
        strict: ``false`` lets a run break a requirement on purpose (warned, recorded as
            ``assumption/violated``).
        out_dir: where run files go (``null``: Hydra's run directory, or the working directory).
        run_name: a stable name: the run directory becomes ``outputs/<run_name>``, so running the
            same command again after a kill resumes the run (``null``: a time-stamped directory).
        faults: injected faults by name (``faults=[crash,desync]`` selects files of ``conf/faults/``;
            each file adds one named entry). Each fires once per run.
    """

    threat: ThreatConf = field(default_factory=ThreatConf)
    aggregator: Any = MISSING
    preaggregation: Any = None
    attack: Any = None
    data: DataConf = field(default_factory=DataConf)
    model: Any = None  # a _target_ node (conf/model/): any nn.Module
    optimizer: Any = None  # a _target_ node with _partial_: true (conf/optimizer/): any torch.optim optimizer
    scheduler: Any = None  # likewise (conf/scheduler/); _target_: null = constant learning rate
    protocol: Any = None  # a _target_ node (conf/protocol/): a robustagg.protocols.Protocol
    trainer: TrainerConf = field(default_factory=TrainerConf)
    logger: LoggerConf = field(default_factory=LoggerConf)
    server: ServerConf = field(default_factory=ServerConf)
    seed: Any = 0
    strict: bool = True
    out_dir: Optional[str] = None
    run_name: Optional[str] = None
    faults: Dict[str, Any] = field(default_factory=dict)  # each entry is checked against FaultConf


def run_name_problem(name: str) -> str:
    """Why ``name`` cannot be a ``run_name`` (a plain, non-empty folder name under ``outputs/``), or ``""``."""
    if name == "":
        return ("run_name='' is empty: give a plain folder name (run_name=alie-tm makes the run folder "
                "outputs/alie-tm, so the same command resumes it), or leave run_name out for a time-stamped folder.")
    if "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        return (f"run_name={name!r} must be a plain folder name (no '/' or '\\', not starting with '.'), e.g. "
                f"run_name=alie-tm; for another folder use out_dir=PATH.")
    return ""


def run_dir_problem(args: list[str]) -> str:
    """Why the run directory the command line ``args`` asks for cannot be written, or ``""``.

    Checked before Hydra starts (Hydra writes its own files there first, and a read-only folder
    would end in its traceback): the folder of ``hydra.run.dir=``, ``out_dir=`` or
    ``outputs/<run_name>`` (default ``outputs/``), or the nearest folder above it that exists,
    must take a file. A sweep (``-m``) is not checked here.
    """
    import os
    import tempfile

    if any(a in ("-m", "--multirun") for a in args):
        return ""
    where = requested_run_dir(args)
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return (f"cannot write the run directory {where}: {exc.strerror} ({probe} does not take a file). Fix: make "
                f"it writable or free space, or choose another folder (hydra.run.dir=..., out_dir=... or run_name=...).")
    return ""


def requested_run_dir(args: list[str]) -> Path:
    """The folder the command line ``args`` names for its run, as far as it can be known before
    Hydra starts: ``hydra.run.dir=``, ``out_dir=``, ``outputs/<run_name>``, or ``outputs`` (the
    default ``outputs/<date>/<time>`` is made under it)."""
    import os

    given = {k: v for k, _, v in (a.partition("=") for a in args if "=" in a)}
    return Path(given.get("hydra.run.dir") or given.get("out_dir") or
                (os.path.join("outputs", given["run_name"]) if given.get("run_name") else "outputs"))


def folders_before_the_run(args: list[str]) -> set[Path]:
    """The folders that exist, before Hydra starts, at or above the run folder ``args`` names, and
    directly under it (the date folders of ``outputs/``): resolved paths. A refused run removes
    only folders it created (``experiments.train``), never one of these."""
    found: set[Path] = set()
    try:  # a folder that cannot be listed: what was found so far (run_dir_problem reports it)
        where = requested_run_dir(args).expanduser().resolve()
        found |= {q for q in (where, *where.parents) if q.is_dir()}
        if where.is_dir():
            found |= {c.resolve() for c in where.iterdir() if c.is_dir()}
    except (OSError, ValueError):
        pass
    return found


def run_dir_for(out_dir: Optional[str], run_name: Optional[str]) -> str:
    """The run directory Hydra creates (``hydra.run.dir: ${ra_run_dir:${out_dir},${run_name}}``).

    ``out_dir`` when given; else ``outputs/<run_name>`` (an empty name, or one with ``/`` or ``..``, is refused);
    else, under torchrun, ``outputs/torchrun-<TORCHELASTIC_RUN_ID>`` when torchrun set a run id
    (the same on every rank); else ``outputs/<date>/<time>``.

    Raises:
        ValueError: a ``run_name`` that is not a plain folder name (Hydra reports it).
    """
    import os
    import time

    if out_dir not in (None, "", "None"):
        return str(out_dir)
    if run_name not in (None, "None"):
        name = str(run_name)
        problem = run_name_problem(name)
        if problem:
            raise ValueError(problem)
        return os.path.join("outputs", name)
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if os.environ.get("LOCAL_RANK") is not None and rid not in ("", "none"):
        return os.path.join("outputs", f"torchrun-{rid}")
    return os.path.join("outputs", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))


#: The ``conf/`` folder the entry points compose from.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _stored_options(group: str) -> list[str]:
    """The options of ``group`` that Hydra and its plugins keep in the ConfigStore, not in ``conf/``
    (``hydra/launcher=basic``, Hydra's own launcher); read only for ``hydra/...`` groups."""
    if not group.startswith("hydra/"):
        return []
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports the installed plugins, which store their configs
    try:
        names = ConfigStore.instance().list(group)
    except OSError:  # no such group in the store
        return []
    return [name.removesuffix(".yaml") for name in names]


def check_group_choices(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Refuse a command-line ``group=NAME`` or ``group=[a,b]`` that names no file of ``conf/<group>/``.

    Hydra lists the options of a group for ``faults=crashh`` but not for a list value
    (``faults=[crashh]`` reports only "Could not load 'faults/crashh'"); this check names the
    nearest options and all of them, before Hydra composes. Overrides that are not a group choice
    (``trainer.steps=3``), sweeps with functions (``seed=range(3)``) and ``null`` are left to Hydra.

    Args:
        overrides: the command-line overrides (``sys.argv[1:]``; ``-m`` and other flags are skipped).
        conf_dir: the config folder (default: this project's ``conf/``).

    Raises:
        ConfigError: an option that is not a file of the group's folder.
    """
    from robustagg.errors import ConfigError

    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        folder = conf_dir / key
        if not sep or not key or key.startswith(("-", "~")) or "." in key or not folder.is_dir():
            continue
        value = value.strip()
        if any(c in value for c in "()${}'\""):
            continue
        items = [v.strip() for v in value.strip("[]").split(",") if v.strip() and v.strip() != "null"]
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for item in items:
            if not (folder / f"{item}.yaml").is_file() and item not in _stored_options(key):
                options = sorted(set(options) | set(_stored_options(key)))
                near = difflib.get_close_matches(item, options, n=2, cutoff=0.6)
                hint = f" (did you mean {' or '.join(near)}?)" if near else ""
                raise ConfigError(f"{override}: conf/{key}/ has no option {item!r}{hint}; the options: "
                                  f"{', '.join(options)}.")


def moved_settings(node: Any = None, prefix: str = "") -> dict[str, str]:
    """The former settings that moved, ``{dotted path: where to now}``, from the schema's field metadata.

    Such a key is still declared (setting it gets the migration message), but it is no setting:
    no suggestion names it.
    """
    import typing

    node = TrainConfig if node is None else node
    out: dict[str, str] = {}
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        if "moved_to" in f.metadata:
            out[f"{prefix}{f.name}"] = str(f.metadata["moved_to"])
        elif dataclasses.is_dataclass(hints[f.name]):
            out.update(moved_settings(hints[f.name], f"{prefix}{f.name}."))
    return out


def _setting_paths(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every dotted setting path below the dataclass ``node`` (its own fields and, recursively, theirs),
    without the moved ones (:func:`moved_settings`)."""
    import typing

    out: dict[str, Any] = {}
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        if "moved_to" in f.metadata:
            continue
        path = f"{prefix}{f.name}"
        sub = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        out[path] = sub
        if sub is not None:
            out.update(_setting_paths(sub, path + "."))
    return out


def check_setting_keys(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Refuse a command-line ``a.b=VALUE`` whose key is not a setting, in one line, with the nearest keys.

    Hydra's own message for ``trainer.stpes=5`` spans six lines and suggests appending the key
    (``+trainer.stpes=5``), which the schema then refuses. Keys below a typed node of
    :class:`TrainConfig` (``threat``, ``data``, ``trainer``, ``logger``, ``server`` ...) are checked
    against its fields; keys below a free node (``aggregator.f``, ``optimizer.lr``, ``faults.crash.step``),
    group choices, ``hydra.*`` and appended (``+``) or deleted (``~``) keys are left to Hydra.

    Args:
        overrides: the command-line overrides (``sys.argv[1:]``; flags are skipped).
        conf_dir: the config folder (group names are its sub-folders).

    Raises:
        ConfigError: a key that is not a setting, naming the nearest ones (``trainer.stpes``: did you
            mean ``trainer.steps``?).
    """
    from robustagg.errors import ConfigError

    paths = _setting_paths(TrainConfig)
    moved = moved_settings()
    for override in overrides:
        key, sep, _ = override.partition("=")
        key = key.strip()
        if not sep or not key or key.startswith(("-", "+", "~")) or "/" in key or key.split(".")[0] == "hydra":
            continue
        parts = key.split(".")
        if len(parts) == 1 and (conf_dir / key).is_dir():
            continue  # a group choice: check_group_choices
        node: Any = TrainConfig
        for depth in range(len(parts)):
            path = ".".join(parts[:depth + 1])
            if path in paths or path in moved:  # a moved key: its migration message comes later
                node = paths[path]
                if node is None:
                    break  # a leaf or a free node: Hydra and the schema check the rest
                continue
            above = ".".join(parts[:depth])
            siblings = {p.rsplit(".", 1)[-1]: p for p in paths if p.count(".") == depth and
                        (depth == 0 or p.startswith(above + "."))}
            near = [siblings[k] for k in difflib.get_close_matches(parts[depth], list(siblings), n=2, cutoff=0.6)]
            by_name: dict[str, list[str]] = {}
            for p in paths:
                by_name.setdefault(p.rsplit(".", 1)[-1], []).append(p)
            for name in difflib.get_close_matches(parts[depth], list(by_name), n=2, cutoff=0.75):
                near += [p for p in by_name[name] if p not in near]
            where = "the configuration" if depth == 0 else ".".join(parts[:depth])
            hint = f"did you mean {' or '.join(near[:3])}? " if near else ""
            listed = conf_dir / parts[0] / "default.yaml"
            see = (f"the settings are listed in conf/{parts[0]}/default.yaml" if depth and listed.is_file()
                   else "python -m experiments.train --cfg job prints every setting")
            raise ConfigError(f"{override}: {path!r} is not a setting of {where}; {hint}({see}).")


def check_command_line(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Every check of the command line that runs before Hydra composes, in order: the group choices
    (:func:`check_group_choices`), the keys (:func:`check_setting_keys`), the value types against
    the schema (:func:`experiments.value_types.check_override_types`) and ``run_name``.

    Raises:
        ConfigError: the first problem, in one line.
    """
    from robustagg.errors import ConfigError

    from .value_types import check_override_types

    check_group_choices(overrides, conf_dir)
    check_setting_keys(overrides, conf_dir)
    groups = [o for o in overrides if (conf_dir / o.lstrip("+~").partition("=")[0]).is_dir()]
    check_override_types([o for o in overrides if o not in groups], TrainConfig)  # faults=[crash]: a group choice
    for arg in overrides:  # Hydra resolves the run directory from run_name before any of our code
        if arg.startswith("run_name=") and run_name_problem(arg.partition("=")[2]):
            raise ConfigError(run_name_problem(arg.partition("=")[2]))


def register_configs() -> None:
    """Store :class:`TrainConfig` as ``train_schema`` and register the ``ra_run_dir`` resolver (idempotent)."""
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("ra_run_dir"):
        OmegaConf.register_new_resolver("ra_run_dir", run_dir_for)


register_configs()
