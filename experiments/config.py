"""Structured-config schemas of ``conf/`` (registered in Hydra's ConfigStore as ``train_schema``).

Every typed node refuses keys it does not declare, so a misspelt key (``trainer.setps=10``) is an
error at composition, never silently ignored. The ``aggregator``, ``preaggregation`` and
``attack`` nodes carry a ``_target_`` and the class's own parameters; they are checked against the
class's signature by :func:`experiments.wiring.validate` before any process starts.

``n`` and the declared ``f`` are set once, in ``threat``, and interpolated everywhere else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

__all__ = ["Mode", "Partition", "DataName", "ByzantineData", "ThreatConf", "DataConf", "ModelConf", "TrainerConf",
           "LoggerConf", "TrainConfig", "register_configs"]


class Mode(str, enum.Enum):
    """``processes``: one OS process per worker over torch.distributed; ``simulated``: all in one."""

    processes = "processes"
    simulated = "simulated"


class Partition(str, enum.Enum):
    """How the training set is split among workers (see :func:`experiments.data.partition`)."""

    iid = "iid"
    dirichlet = "dirichlet"
    label_sorted = "label_sorted"
    long_tail = "long_tail"


class DataName(str, enum.Enum):
    """Bundled data sets."""

    digits = "digits"
    synthetic = "synthetic"


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
    start_step: int = 0


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
    """

    name: DataName = DataName.digits
    partition: Partition = Partition.iid
    alpha: float = 0.5
    shards_per_worker: int = 2
    imbalance: float = 10.0
    min_samples: int = 1
    max_tries: int = 100
    byzantine_data: ByzantineData = ByzantineData.partition
    test_fraction: float = 0.25
    max_train_samples: Optional[int] = None
    dim: int = 20
    num_classes: int = 10
    samples: int = 4000
    separation: float = 3.0
    heterogeneity: float = 0.0


@dataclass
class ModelConf:
    """``mlp`` (hidden widths, dropout) or ``cnn`` (conv channels; needs image data such as digits)."""

    name: str = "mlp"
    hidden: List[int] = field(default_factory=lambda: [64])
    channels: List[int] = field(default_factory=lambda: [8, 16])
    dropout: float = 0.0


@dataclass
class TrainerConf:
    """The training loop and its transport.

    Attributes:
        mode: ``processes`` or ``simulated``.
        steps: optimizer steps. batch_size: per worker per step.
        lr, momentum, weight_decay, nesterov: server-side SGD. scheduler: ``none`` or ``cosine``.
        worker_momentum: beta of each worker's momentum (0 = off).
        eval_every: evaluate on the test set every K steps (and at the end).
        param_check_every: compare a parameter digest across ranks every K steps (and at the end).
        reduction: the robust reduction mode (``gather``).
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
    """

    mode: Mode = Mode.processes
    steps: int = 300
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    scheduler: str = "none"
    worker_momentum: float = 0.0
    eval_every: int = 50
    param_check_every: int = 100
    reduction: str = "gather"
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
class TrainConfig:
    """The whole configuration of ``python -m experiments.train``.

    Attributes:
        seed: every random choice (data split, partition, init, batches, attack noise) derives from it.
        strict: ``false`` lets a run break a requirement on purpose (warned, recorded as
            ``assumption/violated``).
        out_dir: where run files go (``null``: Hydra's run directory, or the working directory).
    """

    threat: ThreatConf = field(default_factory=ThreatConf)
    aggregator: Any = MISSING
    preaggregation: Any = None
    attack: Any = None
    data: DataConf = field(default_factory=DataConf)
    model: ModelConf = field(default_factory=ModelConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    logger: LoggerConf = field(default_factory=LoggerConf)
    seed: int = 0
    strict: bool = True
    out_dir: Optional[str] = None


def register_configs() -> None:
    """Store :class:`TrainConfig` as ``train_schema`` (idempotent)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


register_configs()
