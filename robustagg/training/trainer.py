"""One robust training step, written once for every worker a process hosts.

In ``processes`` mode each process hosts one worker (its rank); in ``simulated`` mode one process
hosts all n. The step is the same code either way, so on CPU with one thread both modes produce
bit-identical parameters for the same seed.

The step is written over a :class:`~robustagg.protocols.Protocol` (default
:class:`~robustagg.protocols.DSGD`): the protocol's plan names the update's members, each hosted
member's submission comes from ``protocol.submit`` and the server update from
``protocol.apply``; everything between (headers, attacks, integrity, the rule) is the same for
every protocol. Under ``dsgd`` (below) every worker is a member and submits one gradient.

Step (every process, ``dsgd``)::

    for each hosted worker r:   batch <- shard_r (sampler position) ; labels (or the whole batch)
                                poisoned if r is Byzantine under a data attack ; g_r <- grad of the loss, flattened
                                over the whole model ; worker momentum m_r <- b m_r + (1 - b) g_r
    announce: header exchange (step, collective number, d, dtype, previous aggregate digest,
                                arrival time, stop request)
    if a gradient attack is active: all-gather every g (omniscient attackers see this step's
                                honest submissions, after the non-finite policy: under drop only
                                the finite ones, under abort every rank stops) ; Byzantine
                                workers replace theirs
    reduce: submissions framed with their checksums, integrity, rule -> aggregate
    p.grad <- aggregate ; optimizer.step() ; scheduler.step() ; step += 1

With ``batched_gradients=True`` the hosted workers' batches are drawn in the same order and their
gradients computed together, in one ``torch.func.vmap`` per batch shape, before the loop above
(:mod:`~robustagg.training.batched`).

An optional :class:`~robustagg.training.faults.FaultInjector` is called at fixed points of the step
(start, each worker's compute, each submission, before the header exchange, each wire frame, after
the reduction, after the optimizer step), so injected faults are deterministic in (rank, step).
Workers have a *worker id* (their rank in the original group) that stays with their data, sampler
and RNG stream when an elastic shrink renumbers the ranks.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._tensor import flatten, unflatten_like
from ..distributed.lifeline import stop_requested
from ..distributed.reduction import Reduced, Reduction
from ..errors import ConfigError, ShapeError
from ..integrity import checksum
from .batched import (BatchedDecision, BatchedGradients, Prefetched, example_batch, parse_batched, resolve_batched,
                      run_shapes)
from .byzantine import ByzantineBehaviour
from .precision import MAX_BACKOFFS, Precision, Retry, autocast, new_scaler, parse_precision, submission_dtype
from .sampler import ShardSampler, mix_seed
from .schedules import restore_schedule
from .state import capture_rng, restore_rng
from .shard_protection import ShardProtection
from .state_sharding import OptimizerShard, full_shard, state_for

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.header import Header
    from ..protocols.base import Protocol, RoundPlan
    from .faults import FaultInjector

__all__ = ["Shard", "StepOutput", "Trainer"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Shard:
    """One worker's training data: inputs ``x`` ``(N, ...)`` and int64 labels ``y`` ``(N,)``."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ShapeError(f"shard x and y differ in length: {self.x.shape[0]} vs {self.y.shape[0]}.")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device) -> "Shard":
        """This shard on ``device``."""
        return Shard(self.x.to(device), self.y.to(device))


@dataclass
class StepOutput:
    """What one step produced (identical on every rank except ``reduced.weights``).

    Attributes:
        step: the id of the step just taken (0-based; the trainer's counter is now ``step + 1``).
        reduced: the reduction's outcome (aggregate, matrix, kept rows, headers, ...).
        byzantine: ranks that attacked at this step (members of the update only).
        losses: every member's training loss on its batch, in ``reduced.members`` order (from the
            headers; Byzantine ranks report the loss of their honest computation).
        seconds: wall time of the step in this process.
        plan: the protocol's :class:`~robustagg.protocols.RoundPlan` of this update.
        honest_inputs: per row the rule received, whether it is honest (the protocol's view).
        bias: ``agg/bias_vs_sync`` and ``agg/bias_vs_sync_rel`` on the main process when the
            trainer measures bias and the protocol can evaluate its reference, else ``None``.
        detections: the protocol's detection records of this update (e.g. replica-vote
            disagreements), see :meth:`Protocol.detections <robustagg.protocols.Protocol.detections>`,
            then the aggregate cross-check's (``lying_aggregator``, :mod:`~robustagg.distributed.vote`).
        exclude: ranks the cross-check named with ``on_lying_aggregator=exclude`` (the loop stops the
            attempt after recording them, see :func:`~robustagg.training.fit`).
        node_metrics: a mixing protocol's per-step numbers (``gossip/*``, see
            :meth:`Protocol.mix <robustagg.protocols.Protocol.mix>`), else ``None``; the step record
            then has them instead of the server rule's ``agg/*`` metrics (there is no server aggregate).
    """

    step: int
    reduced: Reduced
    byzantine: tuple[int, ...]
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    plan: Optional["RoundPlan"] = None
    honest_inputs: Optional[list[bool]] = None
    bias: Optional[dict[str, float]] = None
    detections: list[dict[str, Any]] = field(default_factory=list)
    exclude: list[int] = field(default_factory=list)
    node_metrics: Optional[dict[str, float]] = None

    def honest_mask(self) -> torch.Tensor:
        """``(len(reduced.inputs),)`` bool: True for the honest rows the rule received."""
        if self.honest_inputs is not None:
            return torch.tensor(self.honest_inputs, dtype=torch.bool)
        return torch.tensor([r not in self.byzantine for r in self.reduced.inputs], dtype=torch.bool)


def _as_source(obj: Any, rank: int) -> Any:
    from .sources import BatchSource

    if not isinstance(obj, BatchSource):
        raise ConfigError(f"shards[{rank}] must be a Shard or a BatchSource (next_batch, state_dict, load_state_dict); "
                          f"got {type(obj).__name__}. Wrap an iterable or DataLoader in "
                          f"robustagg.training.IterableSource.")
    return obj


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.clone()


def _scaler_state(scaler: Optional[torch.amp.GradScaler]) -> Optional[dict[str, Any]]:
    return None if scaler is None else dict(scaler.state_dict())


def _load_scaler(scaler: Optional[torch.amp.GradScaler], state: Optional[dict[str, Any]], precision: Precision,
                 wid: int) -> None:
    if (scaler is None) != (state is None):
        raise ConfigError(f"worker {wid}'s checkpointed state {'has no' if state is None else 'has a'} fp16 loss "
                          f"scaler but this trainer runs precision={precision.value}; resume with the precision "
                          "the checkpoint was written with.")
    if scaler is not None and state is not None:
        scaler.load_state_dict(state)


class Trainer:
    """Data-parallel robust training of one model by ``n`` workers, some of them Byzantine.

    Args:
        model: the model (identically initialised in every process).
        optimizer: over ``model.parameters()``; stepped with the robust aggregate as gradient.
        reduction: a :class:`~robustagg.distributed.Reduction` (its communicator says which
            workers this process hosts).
        shards: ``{rank: Shard | BatchSource}`` for exactly the hosted workers: in-memory tensors
            (batched by a :class:`~robustagg.training.ShardSampler`) or any
            :class:`~robustagg.training.BatchSource` (e.g. an
            :class:`~robustagg.training.IterableSource` over a DataLoader) whose position is
            checkpointed.
        batch_size: examples per worker per step.
        num_classes: number of classes (handed to the label poison).
        seed: the run's seed (data order of every worker derives from it).
        loss_fn: ``(logits, labels) -> scalar``; default mean cross-entropy.
        scheduler: optional learning-rate scheduler, stepped after every optimizer step.
        worker_momentum: ``beta`` in ``[0, 1)`` of the worker momentum ``m <- beta m + (1 - beta) g``
            (Karimireddy, He, Jaggi, ICML 2021); 0 disables it.
        byzantine: the injected :class:`ByzantineBehaviour`, or ``None`` (everyone honest).
        metrics: compute the rule's row weights on the main process (for ``agg/*`` metrics).
        identities: ``{rank: worker id}`` for the hosted workers (default: the rank itself). The
            worker id seeds the worker's batches and RNG stream and keys its checkpointed state,
            so a worker keeps its trajectory when an elastic shrink gives it another rank.
        injector: a :class:`~robustagg.training.faults.FaultInjector` (fault injection), or ``None``.
        batch_loss: ``(model, batch) -> scalar``: the loss over any batch a source yields
            (default: ``loss_fn(model(x), y)`` for ``(x, y)`` batches).
        root: the server's clean root data set (the same in every process), or ``None``. Each step,
            before the reduction, every process computes the plain gradient on all of it (no
            momentum; dropout drawn from a stream seeded by ``(seed, step)``) and hands it to the
            rule's ``set_trusted`` (FLTrust, Cao et al., NDSS 2021; the rule of a Pipeline).
        protocol: the :class:`~robustagg.protocols.Protocol` (default
            :class:`~robustagg.protocols.DSGD`: every worker, one fresh gradient per update).
        measure_bias: compute ``agg/bias_vs_sync`` every update on the main process (the
            protocol's synchronous full-participation reference; extra computation).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``: the workers' forward pass and loss under
            autocast, fp16 with a loss scaler per worker; submissions are float32 either way (see
            :mod:`~robustagg.training.precision`).
        batched_gradients: ``True``: compute the hosted workers' gradients of an update in one
            ``torch.func.vmap`` call (:mod:`~robustagg.training.batched`; not bit-identical to the
            per-worker loop in general, see there); ``False`` (default): the per-worker loop;
            ``"auto"``: decided here by :func:`~robustagg.training.batched.resolve_batched`, as
            the app decides it (the model, protocol, precision, a dry run on two examples of the
            first hosted :class:`Shard`, and the bit-identity probe at the hosted workers' batch
            sizes; no ``Shard`` hosted: off). The decision is
            :attr:`batched_decision`.
        state_sharding: ``"none"`` or ``"optimizer"``: this process owns the optimizer state of
            the coordinates its rank aggregates (:func:`~robustagg.distributed.sharded.shard_bounds`)
            and applies the server step to them; the parameter slices are all-gathered after
            (:class:`~robustagg.training.state_sharding.OptimizerShard`; bit-identical parameters).
            Needs a process group with one worker per process, protocol ``dsgd``, an optimizer of
            :data:`~robustagg.training.state_sharding.ELEMENTWISE` over every trainable parameter.
        shard_redundancy: ``k``: with ``state_sharding="optimizer"``, every slice's state is also
            held by the next ``k - 1`` ranks, which apply the same step to it (1: no copies);
            ``shard_parity``: ``g``: an XOR parity of every group of ``g`` slices is kept on a
            rank outside the group (0: none). Either one snapshots the state at every step's
            start, so that survivors can rebuild a lost rank's shard without replaying steps
            (:mod:`~robustagg.training.shard_recovery`).

    Raises:
        ConfigError: hosted workers and shards differ, Byzantine ranks out of range, every worker
            Byzantine, ``worker_momentum`` outside ``[0, 1)``, or ``identities`` not covering the
            hosted workers with distinct ids, an unknown ``precision``, or ``fp16`` with an
            optimizer that does not hold every trainable parameter (the scaler unscales through it),
            or ``batched_gradients=True`` with a model, protocol or precision that
            :func:`~robustagg.training.batched.check_batchable` refuses, or ``batched_gradients``
            other than ``True``, ``False``, ``"auto"`` (or their strings), or ``state_sharding``
            unknown or outside its needs (above), or ``shard_redundancy``/``shard_parity`` without
            sharded state or beyond the world size
            (:func:`~robustagg.training.shard_protection.check_protection`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, reduction: Reduction,
                 shards: Mapping[int, Any], *, batch_size: int, num_classes: int, seed: int = 0,
                 loss_fn: LossFn = F.cross_entropy, scheduler: Optional[Any] = None, worker_momentum: float = 0.0,
                 byzantine: Optional[ByzantineBehaviour] = None, metrics: bool = True,
                 identities: Optional[Mapping[int, int]] = None, injector: Optional["FaultInjector"] = None,
                 batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                 root: Optional[Shard] = None, protocol: Optional["Protocol"] = None,
                 measure_bias: bool = False, precision: Any = "32", batched_gradients: Union[bool, str] = False,
                 state_sharding: str = "none", shard_redundancy: int = 1, shard_parity: int = 0) -> None:
        self.comm = reduction.comm
        self.root, self.seed = root, int(seed)
        if sorted(shards) != list(self.comm.local_ranks):
            raise ConfigError(f"shards must be given for the hosted workers {list(self.comm.local_ranks)}; "
                              f"got {sorted(shards)}.")
        ids = {r: r for r in self.comm.local_ranks} if identities is None else {int(k): int(v)
                                                                              for k, v in identities.items()}
        if any(r not in ids for r in self.comm.local_ranks) or len(set(ids.values())) != len(ids):
            raise ConfigError(f"identities must give a distinct worker id to each hosted worker "
                              f"{list(self.comm.local_ranks)}; got {ids}.")
        #: ``{rank: worker id}`` of the hosted workers.
        self.identities = {r: ids[r] for r in self.comm.local_ranks}
        if not 0.0 <= worker_momentum < 1.0:
            raise ConfigError(f"worker_momentum must be in [0, 1); got {worker_momentum}.")
        n = self.comm.world_size
        if byzantine is not None:
            if any(r >= n for r in byzantine.ranks):
                raise ConfigError(f"Byzantine ranks {list(byzantine.ranks)} out of range for n={n} workers.")
            if len(byzantine.ranks) >= n:
                raise ConfigError(f"at least one worker must be honest; got {len(byzantine.ranks)} Byzantine of n={n}.")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.reduction = reduction
        self.shards = dict(shards)
        self.num_classes = int(num_classes)
        self.loss_fn = loss_fn
        self.worker_momentum = float(worker_momentum)
        self.byzantine = byzantine
        self.metrics = bool(metrics)
        self.step_id = 0
        self.batch_loss = batch_loss
        #: this process's slice of the optimizer state (``state_sharding="optimizer"``), else ``None``.
        self.optimizer_shard: Optional[OptimizerShard] = self._shard_optimizer(str(state_sharding), protocol)
        #: the copies or parity this rank keeps of the sharded state, and its snapshots (else ``None``).
        self.protection: Optional[ShardProtection] = None
        if int(shard_redundancy) != 1 or int(shard_parity) != 0:
            if self.optimizer_shard is None:
                raise ConfigError(f"shard_redundancy={shard_redundancy} / shard_parity={shard_parity} protect the "
                                  "sharded optimizer state: they need state_sharding=optimizer.")
            self.protection = ShardProtection(self.optimizer_shard, int(shard_redundancy), int(shard_parity))
        #: the position of every hosted worker's data: a sampler over a Shard, or the source itself.
        self.samplers: dict[int, Any] = {
            r: (ShardSampler(len(s), batch_size, seed=seed, rank=self.identities[r]) if isinstance(s, Shard) else
                _as_source(s, r)) for r, s in self.shards.items()}
        self.momentum: dict[int, Optional[torch.Tensor]] = {r: None for r in self.shards}
        # Each worker's own torch CPU RNG stream (dropout and other randomness in the forward and
        # backward pass), swapped in around its gradient: the streams do not depend on how workers
        # are spread over processes, so simulated and multi-process runs draw the same numbers.
        self.worker_rng = {r: torch.Generator().manual_seed(mix_seed(seed, self.identities[r], 0x5EED)).get_state()
                           for r in self.shards}
        device = self.params[0].device if self.params else torch.device("cpu")
        #: The workers' compute precision, and each hosted worker's fp16 loss scaler (else ``None``).
        self.precision = parse_precision(precision)
        self.scalers = {r: new_scaler(self.precision, device) for r in self.shards}
        if self.precision is Precision.fp16:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if any(id(p) not in held for p in self.params):
                raise ConfigError("precision=fp16 unscales the gradients through the optimizer, which must hold every "
                                  "trainable parameter of the model; build it over model.parameters().")
        self._device = device
        self.attack_generator = torch.Generator(device=device)
        self.attack_generator.manual_seed(byzantine.seed if byzantine is not None else 0)
        self.injector = injector
        if injector is not None and injector.has("corrupt"):
            reduction.tamper = injector.tamper
        if injector is not None and injector.has("aggregator_lie"):
            reduction.check.injector = injector  # the cross-check asks it who lies, and how
        #: 0-based id of the step in progress (``None`` between steps): failure evidence.
        self.current_step: Optional[int] = None
        #: The last step's headers and when their exchange finished (``time.time()``): evidence.
        self.last_headers: list["Header"] = []
        self.last_headers_at: Optional[float] = None
        if protocol is None:
            from ..protocols.dsgd import DSGD

            protocol = DSGD()
        #: The training protocol (who submits what per update, how the server applies it).
        self.protocol = protocol
        self.measure_bias = bool(measure_bias)
        #: The batched per-worker gradients (``batched_gradients=True``), else ``None``; and the
        #: gradients they computed ahead for the update in progress, ``{rank: Prefetched}``.
        self.batched: Optional[BatchedGradients] = None
        self._prefetched: dict[int, Prefetched] = {}
        auto = parse_batched(batched_gradients) == "auto"
        #: How ``batched_gradients`` was decided (``on``, the setting, the reason).
        sizes, counts = run_shapes(int(batch_size), [len(getattr(sh, "y", ())) for sh in self.shards.values()],
                                   len(self.shards))
        self.batched_decision: BatchedDecision = resolve_batched(
            batched_gradients, model, protocol=protocol, precision=self.precision,
            example=example_batch(self.shards, device) if auto else None, loss_fn=loss_fn, batch_loss=batch_loss,
            batch_sizes=sizes, workers=counts)
        if self.batched_decision.on:
            self.batched = BatchedGradients(model, loss_fn=loss_fn, batch_loss=batch_loss)
        if byzantine is not None and byzantine.gossip_fn is not None and not protocol.mixes:
            raise ConfigError(f"the Byzantine behaviour {byzantine.name!r} is a gossip attack (each neighbour gets its "
                              f"own message) but protocol {protocol.name!r} has a server aggregate: use "
                              "robustagg.protocols.Gossip, or a gradient_fn for a server attack.")
        protocol.bind(self)
        #: ``(rank, signal number)`` of the first rank whose header of the last step carried a stop
        #: request (``None``: none did); the same on every rank, so all stop after the same step.
        self.stop_request: Optional[tuple[int, int]] = None

    # ------------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True in the process that logs (rank 0)."""
        return self.comm.is_main

    def num_parameters(self) -> int:
        """``d``: the length of a submission."""
        return sum(p.numel() for p in self.params)

    def _next_batch(self, r: int) -> Any:
        shard = self.shards[r]
        if isinstance(shard, Shard):
            idx = self.samplers[r].next()
            return shard.x[idx], shard.y[idx]
        return self.samplers[r].next_batch()

    def _gradient(self, batch: Any, rank: Optional[int] = None) -> tuple[torch.Tensor, float]:
        """The flattened ``(d,)`` gradient of the loss on ``batch`` and the loss.

        With ``rank`` (a hosted worker) the forward pass and loss run under the trainer's
        :attr:`precision`; the gradient is cast to float32 (:func:`~robustagg.training.precision.submission_dtype`)
        and, under fp16, unscaled by that worker's scaler here, before it is submitted. An fp16
        overflow (finite loss, non-finite gradient) backs the scale off and computes the gradient
        again from the same RNG streams and buffers (:class:`~robustagg.training.precision.Retry`).
        Without ``rank`` (the server's root gradient) it runs in full precision.
        """
        mixed = rank is not None and self.precision is not Precision.full
        scaler = self.scalers.get(rank) if mixed and rank is not None else None
        retry = Retry(self.model, self._device) if scaler is not None else None
        dtype = submission_dtype(self.precision if mixed else Precision.full,
                                 self.params[0].dtype if self.params else torch.float32)
        for attempt in range(MAX_BACKOFFS + 1):
            for p in self.params:
                p.grad = None
            with autocast(self.precision if mixed else Precision.full, self._device):
                if self.batch_loss is not None:
                    loss = self.batch_loss(self.model, batch)
                else:
                    x, y = batch
                    loss = self.loss_fn(self.model(x), y)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(self.optimizer)  # p.grad *= 1/S in float32 (the parameters' grads are float32)
            g = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]).to(dtype)
            if scaler is None:
                return g.detach(), float(loss.detach())
            scaler.update()  # backs off when unscale_ saw a non-finite gradient, else counts towards growth
            if attempt == MAX_BACKOFFS or bool(torch.isfinite(g).all()) or not bool(torch.isfinite(loss.detach())):
                return g.detach(), float(loss.detach())
            assert retry is not None
            retry.restore()  # the same batch, random numbers and buffers at the backed-off scale
        raise AssertionError("unreachable")  # pragma: no cover

    def worker_batch(self, rank: int, step: int) -> Any:
        """Hosted worker ``rank``'s next batch (its data position advances), poisoned when ``rank`` is
        Byzantine under a data attack that is active at ``step``. Protocols call it."""
        batch = self._next_batch(rank)
        byz = self.byzantine
        if byz is None or rank not in byz.ranks or not byz.active(step):
            return batch
        if byz.poison_fn is not None:
            x, y = batch
            batch = (x, byz.poison_fn(y, self.num_classes))
        if byz.batch_poison_fn is not None:
            x, y = batch
            batch = byz.batch_poison_fn(x, y, self.num_classes, tuple(byz.ranks).index(rank))
        return batch

    def worker_gradient(self, rank: int, step: int) -> tuple[torch.Tensor, float]:
        """Hosted worker ``rank``'s gradient on its next batch at the model's current parameters.

        The worker's own torch RNG stream is swapped in around the computation (dropout and other
        randomness), so the result does not depend on how workers are spread over processes.

        Returns:
            ``(g, loss)``: the flattened ``(d,)`` gradient (the parameters' dtype) and the batch loss
            (computed ahead by :meth:`prefetch_gradients` when that ran for ``rank`` at ``step``).
        """
        ahead = self._prefetched.pop(rank, None)
        if ahead is not None and ahead.step == step:
            return ahead.gradient, ahead.loss
        batch = self.worker_batch(rank, step)
        torch.set_rng_state(self.worker_rng[rank])
        g, loss = self._gradient(batch, rank)
        self.worker_rng[rank] = torch.get_rng_state()
        return g, loss

    def prefetch_gradients(self, ranks: Sequence[int], step: int) -> None:
        """With ``batched_gradients``: compute hosted workers ``ranks``' gradients of update ``step``
        now, in one ``vmap`` per batch shape (:meth:`BatchedGradients.prefetch
        <robustagg.training.batched.BatchedGradients.prefetch>`), for :meth:`worker_gradient` to
        return. Without it, nothing. The step calls it for every hosted member under a protocol whose
        ``batched`` is ``"members"`` (dsgd); a protocol marked ``"self"`` (async) calls it itself.
        """
        if self.batched is not None and ranks:
            self._prefetched = self.batched.prefetch(self, list(ranks), step)

    def step(self) -> StepOutput:
        """Take one update of the protocol on every hosted member; see the module docstring.

        Raises:
            ShapeError: the injected attack returned the wrong shape.
            NonFiniteInputError: an honest submission holds NaN or inf under ``on_nonfinite=abort``
                (raised before an omniscient attack sees it, on every rank).
            DesyncError: and whatever else :meth:`Reduction.reduce` raises (integrity, requirement,
                timeout).
        """
        t0 = time.perf_counter()
        step = self.step_id
        self.current_step = step
        if self.protection is not None:  # the boundary survivors can rebuild a lost shard at
            self.protection.snapshot(self.state_dict())
        inj = self.injector
        if inj is not None:
            inj.step_point("before_step", step)
        proto = self.protocol
        plan = proto.plan(self, step)
        members = plan.members
        member_set = set(members)
        byz = self.byzantine
        active = byz is not None and byz.active(step)
        byz_ranks: tuple[int, ...] = tuple(r for r in byz.ranks if r in member_set) if (byz is not None
                                                                                        and active) else ()
        subs: dict[int, torch.Tensor] = {}
        aux: dict[int, tuple[float, float]] = {}
        self.model.train()  # once per step (it walks every module), not once per hosted worker
        self._prefetched = {}
        if self.batched is not None and proto.batched == "members":
            self.prefetch_gradients([r for r in self.comm.local_ranks if r in member_set], step)
        ahead = {r: p.seconds for r, p in self._prefetched.items()}  # shares of the batched compute time
        for r in self.comm.local_ranks:
            if r not in member_set:
                continue
            tw = time.perf_counter()
            if inj is not None:
                inj.compute(step, r)
            g, loss = proto.submit(self, r, plan)
            if inj is not None:
                g = inj.submission(step, r, g)
            subs[r] = g
            aux[r] = (loss, time.perf_counter() - tw + ahead.get(r, 0.0))  # compute time (straggler evidence)
        announced = step if inj is None else inj.before_announce(self, step)
        subset = None if plan.full else list(members)
        headers = self.reduction.announce(subs, step=announced, aux=aux, stop=stop_requested(), members=subset)
        self.last_headers, self.last_headers_at = headers, time.time()
        self.stop_request = next(((h.rank, h.stop) for h in headers if h.stop), None)
        if proto.mixes:
            return self._mixing_step(plan, subs, headers, byz_ranks, t0)
        if byz_ranks and byz is not None and byz.gradient_fn is not None:
            honest = [i for i in members if i not in byz_ranks]
            mine = [r for r in self.comm.local_ranks if r in byz_ranks]
            if byz.needs_exchange:
                full = self.reduction.share(subs, step=step)  # (len(members), d), members' order
                pos = {r: i for i, r in enumerate(members)}
                # integrity before the attack: under drop it sees only the honest rows the rule will
                # see (the same on every rank); under abort every rank stops here, as reduce would
                finite = self.reduction.finite_rows(full, [pos[r] for r in honest], step=step)
                honest_rows, own = full[finite], full[[pos[r] for r in byz_ranks]]
            else:  # the attack reads only the shapes: no exchange (see ByzantineBehaviour)
                d = self.num_parameters()
                dtype = self.params[0].dtype if not subs else next(iter(subs.values())).dtype
                honest_rows, own = torch.zeros((len(honest), d), dtype=dtype, device=self.comm.device), None
            # every process hosting a Byzantine worker calls the attack whenever one attacks, sampled
            # or not, so a stateful attack advances as in the simulated mode (partial participation)
            if mine or any(r in byz.ranks for r in self.comm.local_ranks):
                if byz.needs_parameters:  # the current model (every worker holds it); see GradientAttack
                    w = flatten([p.detach() for p in self.params])
                    model_aware: Any = byz.gradient_fn
                    rows = model_aware(honest_rows, len(byz_ranks), own, self.attack_generator, parameters=w)
                else:
                    rows = byz.gradient_fn(honest_rows, len(byz_ranks), own, self.attack_generator)
                d = honest_rows.shape[1]
                if tuple(rows.shape) != (len(byz_ranks), d):
                    raise ShapeError(f"the attack {byz.name!r} returned shape {tuple(rows.shape)}; expected "
                                     f"({len(byz_ranks)}, {d}).")
                for r in mine:
                    subs[r] = rows[byz_ranks.index(r)].to(dtype=honest_rows.dtype,
                                                          device=honest_rows.device).contiguous()
        if self.root is not None:
            self._trust_root(step)
        reduced = self.reduction.reduce(subs, step=step, aux=aux, want_weights=self.metrics and self.is_main,
                                        headers=headers, transform=proto.transform(plan))
        if inj is not None:
            inj.step_point("after_reduce", step)  # a crash here: the other ranks apply, this one never does
        bias = self._bias(plan, reduced, byz_ranks) if self.measure_bias else None
        proto.apply(self, reduced.aggregate, plan)
        self.step_id += 1
        if inj is not None:
            inj.step_point("after_step", step)
        self.current_step = None
        return StepOutput(step=step, reduced=reduced, byzantine=byz_ranks,
                          losses=[h.loss for h in reduced.headers], seconds=time.perf_counter() - t0, plan=plan,
                          honest_inputs=proto.honest_inputs(reduced, byz_ranks), bias=bias,
                          detections=proto.detections(plan) + list(self.reduction.check.detections),
                          exclude=list(self.reduction.check.exclude))

    def _mixing_step(self, plan: Any, subs: dict[int, torch.Tensor], headers: list["Header"],
                     byz_ranks: tuple[int, ...], t0: float) -> StepOutput:
        """The rest of :meth:`step` under a mixing protocol: every member's row all-gathered with
        the integrity checks (and the non-finite policy) a reduction applies, then the protocol's
        :meth:`mix` in place of the rule and :meth:`apply`. The step output's aggregate is the
        trainer's model afterwards (the protocol sets it)."""
        step = plan.step
        full = self.reduction.share(subs, step=step)  # (n, d), members' order, checksums checked
        self.reduction.finite_rows(full, list(range(full.shape[0])), step=step)  # abort: raises on NaN/inf
        node_metrics = self.protocol.mix(self, full, plan, byz_ranks)
        members = list(plan.members)
        reduced = Reduced(aggregate=flatten([p.detach() for p in self.params]), step=step, seq=self.comm.seq,
                          headers=headers, matrix=full, kept=members, members=members)
        self.step_id += 1
        if self.injector is not None:
            self.injector.step_point("after_step", step)
        self.current_step = None
        return StepOutput(step=step, reduced=reduced, byzantine=byz_ranks, losses=[h.loss for h in headers],
                          seconds=time.perf_counter() - t0, plan=plan, node_metrics=node_metrics)

    def _bias(self, plan: Any, reduced: Reduced, byz_ranks: tuple[int, ...]) -> Optional[dict[str, float]]:
        """``agg/bias_vs_sync`` (and its relative form) against the protocol's synchronous reference."""
        if not self.is_main:
            return None
        ref = self.protocol.reference(self, plan, reduced, byz_ranks)
        if ref is None:
            return None
        diff = float(torch.linalg.vector_norm(reduced.aggregate.to(torch.float64) - ref.to(torch.float64)))
        size = float(torch.linalg.vector_norm(ref.to(torch.float64)))
        return {"agg/bias_vs_sync": diff, "agg/bias_vs_sync_rel": diff / size if size > 0 else float("nan")}

    def _trust_root(self, step: int) -> None:
        """Give the rule this step's gradient on the root data set (identical in every process)."""
        rule = getattr(self.reduction.rule, "rule", self.reduction.rule)  # a Pipeline's final rule
        if not hasattr(rule, "set_trusted"):
            raise ConfigError(f"root data was given but the rule {rule!r} takes no trusted update; use "
                              "aggregator=fltrust or server.root_samples=0.")
        saved = torch.get_rng_state()
        torch.manual_seed(mix_seed(self.seed, step, 0x7007))
        assert self.root is not None
        g0, _ = self._gradient((self.root.x, self.root.y))
        torch.set_rng_state(saved)
        rule.set_trusted(g0)

    def _shard_optimizer(self, mode: str, protocol: Any) -> Optional[OptimizerShard]:
        if mode not in ("none", "optimizer"):
            raise ConfigError(f"state_sharding must be none or optimizer; got {mode!r}.")
        if mode == "none":
            return None
        from ..distributed import ProcessGroupComm
        from ..distributed.sharded import shard_bounds

        comm = self.comm
        if not isinstance(comm, ProcessGroupComm) or comm.num_processes != comm.world_size:
            raise ConfigError("state_sharding=optimizer gives each process the optimizer state of its rank's slice: it "
                              "needs a process group with one worker per process (trainer.mode=processes, "
                              "trainer.processes=0).")
        name = getattr(protocol, "name", "dsgd") if protocol is not None else "dsgd"
        if name != "dsgd":
            raise ConfigError(f"state_sharding=optimizer applies the server step of protocol dsgd; protocol {name!r} "
                              "has its own update. Use protocol=dsgd or state_sharding=none.")
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if held != {id(p) for p in self.params}:
            raise ConfigError("state_sharding=optimizer needs an optimizer over exactly the model's trainable "
                              "parameters (each coordinate's state is placed by its position in the flat vector).")
        d = sum(p.numel() for p in self.params)
        return OptimizerShard(self.optimizer, self.params, shard_bounds(d, comm.world_size), comm.rank, group=comm.group)

    def apply(self, aggregate: torch.Tensor) -> None:
        """Set every parameter's gradient to its slice of ``aggregate`` and take one optimizer (and
        scheduler) step. :meth:`step` calls it once per step; calling it again re-applies an update
        (what a blind retry does: the ranks that had already applied it move twice).

        Shape: ``aggregate`` ``(d,)``, :meth:`num_parameters` long.
        """
        if self.optimizer_shard is not None:  # this slice's step, then every slice all-gathered
            self.optimizer_shard.local_step(aggregate)
            if self.protection is not None:  # the copies' steps, the parity's all-reduce
                self.protection.after_local_step(aggregate)
            self.optimizer_shard.gather()
            for p in self.params:
                p.grad = None
            self.optimizer.step()  # no gradients: a no-op that keeps the scheduler's step order
        else:
            for p, g in zip(self.params, unflatten_like(aggregate.to(self.params[0].dtype), self.params)):
                p.grad = g.clone()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def parameter_digest(self) -> int:
        """:func:`~robustagg.integrity.checksum` of the flattened parameters."""
        return checksum(flatten([p.detach() for p in self.params]))

    def optimizer_digest(self) -> int:
        """A 64-bit digest of the optimizer's state (every state tensor's bytes and the
        hyperparameters of every parameter group, e.g. the current learning rate)."""
        h = hashlib.blake2b(digest_size=8)
        sd = self.optimizer.state_dict()
        for key in sorted(sd["state"], key=str):
            for name in sorted(sd["state"][key]):
                v = sd["state"][key][name]
                h.update(f"{key}/{name}=".encode())
                h.update(str(checksum(v) if isinstance(v, torch.Tensor) else repr(v)).encode())
        for group in sd["param_groups"]:
            h.update(repr(sorted((k, repr(v)) for k, v in group.items() if k != "params")).encode())
        return int.from_bytes(h.digest(), "little", signed=True)

    def check_parameters(self) -> None:
        """Compare the digests of the parameters and of the optimizer state across ranks.

        Equal weights are not enough: momentum buffers, Adam's moments and step counters must
        agree too, or the next steps diverge.

        Raises:
            DesyncError: some rank holds different parameters or optimizer state.
        """
        self.comm.agree(self.parameter_digest(), what="parameter digest", step=self.step_id)
        self.comm.agree(self.optimizer_digest(), what="optimizer-state digest", step=self.step_id)

    # --- explicit state (issue: committed checkpoints restore all of it) ------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit, split by who owns it.

        Returns:
            ``{"replicated": {...}, "local": {...}}``. ``replicated`` is identical on every rank
            (save it once): ``step``, ``model``, ``optimizer``, ``scheduler`` (or ``None``),
            ``rule`` (the rule's explicit state), ``comm_seq`` (collectives issued so far),
            ``last_digest`` (digest of the last aggregate, checked in the next step's headers),
            ``protocol`` (the protocol's replicated state, e.g. an asynchronous schedule).
            ``local`` is this process's own: ``workers`` ``{worker id: {"sampler", "momentum", "rng",
            "protocol", "scaler"}}``
            for the hosted workers (data position, momentum buffer, the worker's torch CPU RNG
            stream, its fp16 loss scaler's ``state_dict`` or ``None``; keyed by :attr:`identities`,
            the rank itself unless a shrink renumbered the workers), ``rng`` (process-global
            Python/NumPy/torch/CUDA RNG states),
            ``attack`` (the injected attack's state, ``{}`` when stateless or absent) and
            ``attack_generator`` (the generator handed to the attack).
        """
        byz = self.byzantine
        return {
            "replicated": {
                "step": self.step_id,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "rule": self.reduction.rule.state_dict(),
                "comm_seq": self.comm.seq,
                "last_digest": self.reduction.last_digest,
                "protocol": self.protocol.state_dict(),
                **({} if self.optimizer_shard is None else {"optimizer_sharding": {
                    "d": self.optimizer_shard.d, "world": len(self.optimizer_shard.bounds)}}),
            },
            "local": {
                "workers": {self.identities[r]: {"sampler": self.samplers[r].state_dict(),
                                                 "momentum": _clone(self.momentum[r]), "rng": self.worker_rng[r].clone(),
                                                 "protocol": self.protocol.worker_state(r),
                                                 "scaler": _scaler_state(self.scalers[r])}
                            for r in self.comm.local_ranks},
                "rng": capture_rng(),
                "attack": byz.state_dict() if byz is not None else {},
                "attack_generator": self.attack_generator.get_state(),
                **({} if self.optimizer_shard is None else {"optimizer_shard": self.optimizer_shard.export()}),
            },
        }

    def _load_optimizer(self, rep: Mapping[str, Any], loc: Mapping[str, Any]) -> None:
        """The optimizer's hyperparameters from ``rep``; its state from the full state (unsharded
        checkpoint) or from the shards (``rep["optimizer_shards"]``, every rank's, which a restore
        reads; else this rank's own ``loc["optimizer_shard"]``), re-sliced to this trainer's slicing."""
        self.optimizer.load_state_dict(rep["optimizer"])  # hyperparameters, and the full state if unsharded
        if rep.get("optimizer_sharding"):
            shards = list(rep.get("optimizer_shards") or ([loc["optimizer_shard"]] if "optimizer_shard" in loc else []))
        elif self.optimizer_shard is not None:
            shards = [full_shard(rep["optimizer"], self.optimizer, self.params)]
        else:
            return  # unsharded into unsharded: loaded above
        if self.optimizer_shard is not None:
            self.optimizer.state.clear()  # the full optimizer holds hyperparameters only
            self.optimizer_shard.load(shards)
            if self.protection is not None:
                self.protection.load(shards)
            return
        for i, p in enumerate(self.params):  # a sharded checkpoint into an unsharded trainer: reassemble
            st = state_for(shards, i, 0, p.numel(), p)
            if st:
                self.optimizer.state[p] = {k: (v.view_as(p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                           for k, v in st.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the ``local`` part must be this process's own).

        Raises:
            ConfigError: the ``local`` part is for other workers, or holds a loss scaler's state
                where this trainer has none or the reverse (another ``precision``).
        """
        rep, loc = state["replicated"], state["local"]
        by_id = {w: r for r, w in self.identities.items()}
        if sorted(int(r) for r in loc["workers"]) != sorted(by_id):
            raise ConfigError(f"local state is for workers {sorted(int(r) for r in loc['workers'])}, this process "
                              f"hosts workers {sorted(by_id)}.")
        self._prefetched = {}
        self.step_id = int(rep["step"])
        self.model.load_state_dict(rep["model"])
        self._load_optimizer(rep, loc)
        if self.scheduler is not None and rep.get("scheduler") is not None:
            restore_schedule(self.scheduler, rep["scheduler"])  # a length that follows trainer.steps follows it
        self.reduction.rule.load_state_dict(rep["rule"])
        self.comm.seq = int(rep["comm_seq"])
        self.reduction.last_digest = int(rep.get("last_digest", 0))
        self.protocol.load_state_dict(rep.get("protocol") or {})
        for wid, w in loc["workers"].items():
            r = by_id[int(wid)]
            self.samplers[r].load_state_dict(w["sampler"])
            self.momentum[r] = None if w["momentum"] is None else w["momentum"].clone()
            self.worker_rng[r] = w["rng"].clone()
            self.protocol.load_worker_state(r, w.get("protocol") or {})
            _load_scaler(self.scalers[r], w.get("scaler"), self.precision, int(wid))
        restore_rng(loc["rng"])
        if self.byzantine is not None:
            self.byzantine.load_state_dict(loc.get("attack") or {})
        self.attack_generator.set_state(loc["attack_generator"])
