"""Every hosted worker's gradient of one update in one ``torch.func`` call (``trainer.batched_gradients``).

A process that hosts k workers (simulated mode: all n; processes mode with ``trainer.processes=P``:
a block of n/P) computes k gradients of the same model at the same parameters, each on its own
batch. :class:`BatchedGradients` computes them together as
``torch.func.vmap(torch.func.grad_and_value(loss), in_dims=(None, 0))(params, batches)``, the loss
being ``loss_fn(functional_call(model, params, x), y)`` (or the trainer's ``batch_loss``): the
parameters are shared (``in_dims=None``), the k batches are stacked along a new leading dimension
(``in_dims=0``). The result is the ``(k, d)`` matrix of flattened gradients (``d`` the number of
trainable parameters, the parameters' dtype) and the k losses. See Horace He, Richard Zou et al.,
functorch (2021-2022), the ``torch.func`` documentation's "per-sample gradients" recipe, for the
transform; the rule's inputs are exactly the per-worker gradients of the loop.

**What it changes, and what it does not.**

- *Batches and data positions*: the batches are drawn by :meth:`Trainer.worker_batch
  <robustagg.training.Trainer.worker_batch>`, worker by worker in the loop's order, data poisons
  applied there, before the gradient (a poisoned batch is batched like any other).
- *RNG streams*: every worker's torch CPU stream is swapped in between the draws exactly as the loop
  does, so the process-global stream that a data poison may read is the same; the gradient itself
  draws no random numbers (dropout and random augmentation are refused, and ``vmap`` runs with
  ``randomness="error"``), so every worker's stream stays where the loop leaves it. A run may switch
  the flag at a checkpoint (with ``trainer.resume_changes=allow``) and keep its batches.
- *Bits*: **not bit-identical in general.** A batched matrix product (``(k b, in) @ W`` forward,
  ``bmm`` backward) and the batched reductions of the loss may sum in another order than k separate
  calls. Measured on this project's CPU build (torch 2.13, one thread; ``docs/performance.md``,
  "Batched per-worker gradients", ``experiments/batched_compare.py``): the digits MLP's float32
  gradients were bit-identical to the loop's at n = 10 and 100; the SmallCNN's and LeNet-5's
  differed by at most a few float32 ulps of the largest coordinate (relative 4.4e-7 at most), an
  MLP on 784 inputs (MNIST, Fashion-MNIST) by 8.9e-8 relative; in float64 by at most 3e-16 relative. It is harmless for the experiments: it is float32 rounding
  itself, about 3e6 times smaller than the range of the honest workers' gradients that the
  robust rule works on, and every rank applies the same aggregate, so ranks never disagree. Runs
  with the flag on and off are different experiments, so the flag is part of the run's identity.
- *Shapes*: workers whose batches have the same structure, shapes and dtypes are batched together
  (one ``vmap`` per group; an uneven last batch of an :class:`~robustagg.training.IterableSource`
  forms its own group); a batch holding anything other than tensors (in tuples, lists or dicts)
  goes through the trainer's ordinary per-worker gradient.

**When it is on** (:func:`resolve_batched`, before launch: the app's ``validate``, the launcher's
processes for a hand-built :class:`~robustagg.launch.Job`, a ``Trainer`` given ``"auto"``):
``trainer.batched_gradients=auto`` (the default) turns it on exactly when every check below passes,
the dry run on two examples included, and when a probe at the run's own shapes gives the per-worker
loop's gradients bit for bit (:func:`matches_loop`: simulated and processes runs then stay
bit-identical), else off with the reasons (logged in one line, recorded in
the summary); on a resume it keeps the checkpoint's recorded value (an old checkpoint without the
key: ``false``). ``true`` refuses a run that fails a check; ``false`` is the loop. The resolved
value, never ``auto``, is what the fingerprint records.

**What it refuses** (:func:`check_batchable`, for ``true``, before launch in the app and in the
trainer's constructor; ``auto`` turns the flag off for the same reasons): BatchNorm (running
statistics updated in place, and batch statistics that ``vmap`` would have to keep apart),
InstanceNorm with running statistics, dropout and other random layers (per-worker RNG streams),
``precision`` other than ``32`` (autocast and the per-worker fp16 loss scaler's retries), and
protocols whose submissions are not one plain gradient per worker at the current parameters
(``local``: sequential local steps; ``redundant``: replicas are compared bit for bit across
processes, which may batch different numbers of workers; ``gossip``: one model per node).
Data-dependent control flow in the model's forward makes ``vmap`` raise; the dry run turns that
into the same refusal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["BatchedGradients", "BatchedDecision", "Prefetched", "batchable_problems", "check_batchable", "example_batch",
           "matches_loop", "run_shapes",
           "parse_batched", "resolve_batched", "KEY", "VALUES"]

#: The configuration key of the flag (named in every refusal).
KEY = "trainer.batched_gradients"
#: The default shapes of ``auto``'s bit-identity probe (without the run's own): worker batches, rows each.
PROBE_WORKERS, PROBE_ROWS = 4, 32
_FIX = f"use {KEY}=false (the per-worker loop)"


def batchable_problems(model: nn.Module) -> list[str]:
    """Why ``model``'s per-worker gradients cannot be batched with ``vmap`` (``[]``: they can).

    Looks at the modules only (cheap, no forward pass): BatchNorm of any kind, InstanceNorm with
    ``track_running_stats``, dropout with ``p > 0`` (``nn.Dropout*``, ``AlphaDropout``,
    ``FeatureAlphaDropout``), ``nn.RReLU`` and :class:`robustagg.data.Augment` (random crop and
    flip), each named by its module path.

    Args:
        model: the model (any ``nn.Module``).

    Returns:
        one line per offending module, ``"<path> (<type>): <why>"``.
    """
    from ..data.augment import Augment

    out = []
    for name, m in model.named_modules():
        where = f"{name or '<model>'} ({type(m).__name__})"
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out.append(f"{where}: BatchNorm in train mode normalises over each worker's batch and updates running "
                       "statistics in place")
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            out.append(f"{where}: updates running statistics in place")
        elif isinstance(m, (nn.modules.dropout._DropoutNd,)) and float(m.p) > 0:
            out.append(f"{where}: dropout (p={m.p}) draws from each worker's own RNG stream")
        elif isinstance(m, (nn.RReLU, Augment)):
            out.append(f"{where}: draws random numbers from each worker's own RNG stream")
    return out


#: The values of ``trainer.batched_gradients`` (booleans are accepted for ``true`` and ``false``).
VALUES = ("auto", "true", "false")

#: Why a protocol whose ``batched`` attribute is ``None`` is not batched (short form, by name).
_PROTOCOL_WHY = {"local": "runs sequential local steps",
                 "redundant": "compares replicas bit for bit across processes that may batch different numbers "
                              "of workers",
                 "gossip": "keeps one model per node"}


def parse_batched(value: Any, *, key: str = KEY) -> Union[bool, str]:
    """``trainer.batched_gradients`` as ``True``, ``False`` or ``"auto"``.

    Args:
        value: a bool, or one of the strings ``auto``, ``true``, ``false`` (any case; surrounding
            blanks ignored), as a command line or YAML file gives it.
        key: the name to put in the error (default :data:`KEY`).

    Returns:
        ``True``, ``False`` or ``"auto"``.

    Raises:
        ConfigError: anything else, naming ``key``, the value and the three accepted values.

    Example:
        >>> parse_batched("AUTO"), parse_batched(True), parse_batched("false")
        ('auto', True, False)
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text == "auto":
        return "auto"
    if text in ("true", "false"):
        return text == "true"
    raise ConfigError(f"{key} must be one of {', '.join(VALUES)}; got {value!r}. auto (the default) batches the "
                      "per-worker gradients wherever that is valid (docs/performance.md, \"Batched per-worker "
                      "gradients\"); true insists and refuses a run it cannot batch; false is the per-worker loop.")


def _problems(model: nn.Module, protocol: Any, precision: Any, example: Any,
              loss_fn: Optional[Callable[..., torch.Tensor]],
              batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]]) -> list[tuple[str, str]]:
    """Every reason the setting cannot be batched, each as ``(short, long)``: the short form for the
    launch line of ``auto``, the long one for the refusal of ``true``; ``[]``: it can be batched."""
    from .precision import Precision, parse_precision

    problems = []
    for p in batchable_problems(model):
        where, why = p.split(": ", 1)
        kind = ("BatchNorm" if "BatchNorm" in why else "dropout" if "dropout" in why else
                "running statistics" if "running statistics" in why else "random numbers")
        problems.append((f"the model has {kind} at {where}", f"the model's {p}"))
    name = getattr(protocol, "name", "dsgd") if protocol is not None else "dsgd"
    if protocol is not None and getattr(protocol, "batched", None) is None:
        problems.append((f"protocol={name} {_PROTOCOL_WHY.get(name, 'does not submit one plain gradient per worker')}",
                         f"protocol={name} does not submit one plain gradient per worker at the current parameters "
                         "(local rounds take sequential local steps; redundant replicas are compared bit for bit "
                         "across processes that may batch different numbers of workers); dsgd and async do"))
    if parse_precision(precision) is not Precision.full:
        value = getattr(precision, "value", precision)
        problems.append((f"trainer.precision={value} (autocast is not batched)",
                         f"trainer.precision={value}: autocast and the per-worker fp16 loss scaler are not batched; "
                         "use trainer.precision=32"))
    if not problems and example is not None:
        model.train()
        try:
            BatchedGradients(model, loss_fn=loss_fn, batch_loss=batch_loss).gradients([example, example])
        except Exception as exc:  # vmap's own errors (randomness, data-dependent control flow) are RuntimeErrors
            first = str(exc).splitlines()[0] if str(exc) else ""
            problems.append((f"a dry run of torch.func.vmap over the model failed ({type(exc).__name__})",
                             f"a dry run of torch.func.vmap over the model failed: {type(exc).__name__}: {first}"))
    return problems


def check_batchable(model: nn.Module, *, protocol: Any = None, precision: Any = "32",
                    example: Any = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                    batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None) -> None:
    """Refuse a setting whose per-worker gradients cannot be batched (call it before launch).

    The checks of ``trainer.batched_gradients=true``; ``auto`` makes the same ones
    (:func:`resolve_batched`) and turns the flag off instead of refusing.

    Args:
        model: the model (in train mode during training; checked by its modules).
        protocol: the :class:`~robustagg.protocols.Protocol` (``None``: dsgd). Its ``batched``
            attribute says whether the batched gradients can serve it.
        precision: ``trainer.precision``; only ``32`` is accepted.
        example: optionally one batch as the trainer would hand it to the loss (e.g. ``(x[:2],
            y[:2])``): a dry run of the batched gradient on two copies of it, so that
            data-dependent control flow or a random operation inside the forward pass is refused
            here, not at the first step.
        loss_fn: the trainer's ``(logits, labels) -> scalar`` (default mean cross-entropy).
        batch_loss: the trainer's ``(model, batch) -> scalar``, or ``None`` (see :class:`BatchedGradients`).

    Raises:
        ConfigError: naming ``trainer.batched_gradients``, every reason (module paths, the protocol,
            the precision, the dry run's error) and the fix.
    """
    problems = [long for _, long in _problems(model, protocol, precision, example, loss_fn, batch_loss)]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{KEY}=true cannot batch this run's per-worker gradients with torch.func.vmap:\n{lines}\n"
                          f"Fix: {_FIX}, or remove what is listed (e.g. model.dropout=0, a GroupNorm model, "
                          "protocol=dsgd).")


@dataclass(frozen=True)
class BatchedDecision:
    """What ``trainer.batched_gradients`` resolved to, and why (:func:`resolve_batched`).

    Attributes:
        on: the resolved value: ``True`` batches the per-worker gradients, ``False`` is the loop.
            This, never ``"auto"``, is what the fingerprint, ``config_resolved.yaml`` and the
            summary record.
        setting: what was asked: ``"auto"``, ``True`` or ``False``.
        reason: why, in a few words (``"dsgd, MLP without BatchNorm/dropout"``, ``"protocol=local
            runs sequential local steps"``, ...).
    """

    on: bool
    setting: Union[bool, str]
    reason: str

    def describe(self) -> str:
        """The value and why, e.g. ``"on (auto: dsgd, MLP without BatchNorm/dropout)"`` or
        ``"off (set: trainer.batched_gradients=false)"``."""
        how = "auto" if self.setting == "auto" else "set"
        return f"{'on' if self.on else 'off'} ({how}: {self.reason})"

    def line(self) -> str:
        """The launch log line: ``"batched gradients: "`` + :meth:`describe`."""
        return f"batched gradients: {self.describe()}"


def resolve_batched(setting: Any, model: nn.Module, *, protocol: Any = None, precision: Any = "32",
                    example: Any = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                    batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                    recorded: Any = None, batch_sizes: Sequence[int] = (PROBE_ROWS,),
                    workers: Sequence[int] = (PROBE_WORKERS,)) -> BatchedDecision:
    """Decide ``trainer.batched_gradients`` before launch (the app's :func:`experiments.wiring.validate`,
    the library's launcher for a hand-built :class:`~robustagg.launch.Job`, and a
    :class:`~robustagg.training.Trainer` built with ``"auto"`` all call this).

    - ``false``: the per-worker loop.
    - ``true``: the checks of :func:`check_batchable` (with the dry run when ``example`` is given);
      a failed check is refused.
    - ``auto``: the same checks and the bit-identity probe of :func:`matches_loop` at
      ``batch_sizes`` and ``workers``; on exactly when every one passes, else off with the reasons. The
      dry run is part of the checks: without an ``example`` there is no dry run, and ``auto``
      stays off (``"no example batch for the dry run"``). When the run resumes a checkpoint,
      ``recorded`` is the value its fingerprint holds: ``False`` keeps the loop (a run written
      with the loop stays the same experiment), ``True`` is kept when the checks still pass.

    Bound (docs/performance.md, "Batched per-worker gradients"): the digits MLP's float32
    gradients came out bit-identical to the loop's at every step; convolutional models differ by
    a few float32 ulps per step (relative 1e-7 to 4e-7 of the largest coordinate).

    Args:
        setting: ``"auto"``, ``True``, ``False`` (or their strings; :func:`parse_batched`).
        model: the model (checked by its modules; the dry run leaves it in train mode).
        protocol: the :class:`~robustagg.protocols.Protocol` (``None``: dsgd).
        precision: ``trainer.precision``.
        example: one batch as the trainer hands it to the loss (``(x[:2], y[:2])``; see
            :func:`example_batch`), on the model's device, or ``None``.
        loss_fn: the trainer's ``(logits, labels) -> scalar`` (default mean cross-entropy).
        batch_loss: the trainer's ``(model, batch) -> scalar``, or ``None`` (see :class:`BatchedGradients`).
        recorded: the resumed checkpoint's value of the key (``True``/``False``), or ``None``
            for a fresh run (anything else counts as ``None``).
        batch_sizes: the run's batch sizes, for ``auto``'s bit-identity probe (:func:`matches_loop`;
            :func:`run_shapes` gives them).
        workers: the worker counts one ``vmap`` call takes in the run, for the same probe.

    Returns:
        a :class:`BatchedDecision`.

    Raises:
        ConfigError: ``setting`` is not one of :data:`VALUES` (naming the key); ``true`` with a
            setting that cannot be batched (:func:`check_batchable`'s message).
    """
    value = parse_batched(setting)
    if value is False:
        return BatchedDecision(False, False, f"{KEY}=false")
    if value is True:
        check_batchable(model, protocol=protocol, precision=precision, example=example, loss_fn=loss_fn,
                        batch_loss=batch_loss)
        return BatchedDecision(True, True, f"{KEY}=true")
    if recorded is False:
        return BatchedDecision(False, "auto", "resuming a checkpoint written with the per-worker loop")
    problems = [short for short, _ in _problems(model, protocol, precision, example, loss_fn, batch_loss)]
    if problems:
        return BatchedDecision(False, "auto", "; ".join(problems))
    if example is None:
        return BatchedDecision(False, "auto", "no example batch for the dry run of torch.func.vmap")
    if not matches_loop(model, example, loss_fn=loss_fn, batch_loss=batch_loss, batch_sizes=batch_sizes,
                        workers=workers):
        return BatchedDecision(False, "auto", "the batched gradients differ from the per-worker loop's in their last "
                                              "bits for this model (simulated and processes runs would then differ)")
    name = getattr(protocol, "name", "dsgd") if protocol is not None else "dsgd"
    inner = getattr(model, "module", model)
    text = f"{name}, {type(inner).__name__} without BatchNorm/dropout"
    if recorded is True:
        text += "; as the resumed checkpoint was written"
    return BatchedDecision(True, "auto", text)


def matches_loop(model: nn.Module, example: Any, *, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                 batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                 batch_sizes: Sequence[int] = (PROBE_ROWS,), workers: Sequence[int] = (PROBE_WORKERS,)) -> bool:
    """Whether the batched gradients equal the per-worker loop's **bit for bit** on a probe (``auto``'s last check).

    The probe: for every batch size ``b`` in ``batch_sizes`` and every worker count ``k`` in
    ``workers`` (the run's own: its batch size and every smaller shard's size; the workers one
    ``vmap`` call takes in a simulated run and in a process), ``k`` batches of ``b`` rows made from
    ``example`` (its rows cycled, plus seeded Gaussian noise of scale 0.1 so that no two rows are
    equal; the labels cycled and rolled per batch), their gradients computed once by
    :class:`BatchedGradients` and once as the trainer's loop computes them (forward, loss,
    ``backward``, the ``.grad`` of every parameter flattened), compared with :func:`torch.equal`.
    Whether two such computations add the same terms in the same order depends on the shapes and
    the BLAS path, not on the values (the digits MLP matches at 32 rows and not at 1 or 7 on this
    build), so the probe is made at the run's own shapes; it predicts the run, it does not prove it. Only a floating ``(x, y)`` example can be
    probed: anything else (token ids, a custom ``batch_loss`` batch) returns ``False``, the safe side.
    Parameter ``.grad`` fields are left as ``None``; the model is left in train mode.

    Args:
        model: the model; example: ``(x, y)`` with ``x`` ``(m, ...)`` floating and ``y`` ``(m,)``,
            ``m >= 1``; loss_fn, batch_loss: as the trainer's (default mean cross-entropy).
        batch_sizes: the batch sizes the run draws (default ``(PROBE_ROWS,)``).
        workers: the numbers of workers one ``vmap`` call takes (default ``(PROBE_WORKERS,)``).

    Returns:
        ``True`` when every probe gradient is bitwise equal to the loop's.

    An error inside the model propagates (the dry run before this probe has already passed).

    Source: this project's bound (docs/performance.md, "Batched per-worker gradients": the digits MLP
    bit-identical, a 784-input MLP and the convolutional models a few float32 ulps apart).
    """
    import torch.nn.functional as F

    if not (isinstance(example, (tuple, list)) and len(example) == 2 and isinstance(example[0], torch.Tensor)
            and isinstance(example[1], torch.Tensor) and example[0].is_floating_point() and len(example[1]) > 0):
        return False
    x, y = example
    model.train()
    batched = BatchedGradients(model, loss_fn=loss_fn, batch_loss=batch_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_of = loss_fn if loss_fn is not None else F.cross_entropy
    try:
        for b in sorted({int(v) for v in batch_sizes if int(v) >= 1}):
            g = torch.Generator().manual_seed(b)
            cyc = torch.arange(b) % len(y)
            most = max(1, max(int(k) for k in workers))
            batches = []
            for k in range(most):
                noise = torch.randn((b, *x.shape[1:]), generator=g, dtype=x.dtype).to(x.device)
                batches.append((x[cyc] + 0.1 * noise, y[torch.roll(cyc, k)]))
            loop = []
            for batch in batches:
                for p in params:
                    p.grad = None
                loss = batch_loss(model, batch) if batch_loss is not None else loss_of(model(batch[0]), batch[1])
                loss.backward()
                loop.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                       for p in params]))
            for k in sorted({max(1, int(v)) for v in workers}):
                rows, _ = batched.gradients(batches[:k])
                if not all(torch.equal(loop[i], rows[i].to(loop[i].dtype)) for i in range(k)):
                    return False
        return True
    finally:
        for p in params:
            p.grad = None


def run_shapes(batch_size: int, shard_sizes: Sequence[int], hosted: int) -> tuple[list[int], list[int]]:
    """``(batch_sizes, workers)`` for :func:`matches_loop`: every batch size a run draws (``min(batch_size,
    shard size)`` per worker, :class:`~robustagg.training.ShardSampler`) and the worker counts one ``vmap``
    call can take: 1 (a process hosting one worker), ``hosted`` (the workers of one process, every worker
    in a simulated run) and, per batch size, how many workers draw it (``vmap`` groups by shape).

    Args:
        batch_size: ``trainer.batch_size`` (>= 1). shard_sizes: each hosted worker's number of
            examples (sizes below 1, a worker without a ``Shard``, are left out).
        hosted: the workers one process hosts (a simulated run: all ``n``).

    Returns:
        ``(batch_sizes, workers)``: sorted lists of ints (``[batch_size]`` when no size is known).

    Raises nothing for integer arguments. Needs no (n, f) assumption. Source: this project's
    sampler (``min(batch_size, shard size)``) and :class:`BatchedGradients`' grouping by shape.

    Example:
        >>> run_shapes(32, [100, 100, 7], 3)
        ([7, 32], [1, 2, 3])
    """
    hosted = max(1, int(hosted))
    per = [min(int(batch_size), int(m)) for m in shard_sizes if int(m) >= 1]
    sizes = sorted(set(per) or {int(batch_size)})
    groups = {min(hosted, per.count(b)) for b in set(per)}
    return sizes, sorted({1, hosted} | groups)


def example_batch(shards: Mapping[int, Any], device: Optional[torch.device] = None) -> Any:
    """Two examples of the first hosted :class:`~robustagg.training.Shard`, ``(x[:2], y[:2])``, for the
    dry run of :func:`resolve_batched`; ``None`` when no shard is a ``Shard`` (a
    :class:`~robustagg.training.BatchSource` is not read ahead: that would move its position).

    Args:
        shards: ``{rank: Shard | BatchSource}`` (the trainer's hosted workers).
        device: where to put the examples (the model's device); ``None``: where they are.

    Returns:
        ``(x, y)`` with ``x`` ``(min(2, N), ...)`` and ``y`` ``(min(2, N),)``, or ``None``.
    """
    for r in sorted(shards):  # a Shard by its tensors x and y (the trainer module imports this one)
        x, y = getattr(shards[r], "x", None), getattr(shards[r], "y", None)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and len(y) > 0:
            x, y = x[:2], y[:2]
            return (x, y) if device is None else (x.to(device), y.to(device))
    return None


def _signature(batch: Any) -> Optional[Hashable]:
    """Structure, shapes and dtypes of a batch of tensors in tuples/lists/dicts; ``None`` otherwise."""
    if isinstance(batch, torch.Tensor):
        return ("t", tuple(batch.shape), batch.dtype, batch.device)
    if isinstance(batch, (tuple, list)):
        parts = [_signature(b) for b in batch]
        return None if any(p is None for p in parts) else (type(batch).__name__, tuple(parts))
    if isinstance(batch, dict):
        parts = [_signature(batch[k]) for k in batch]
        return None if any(p is None for p in parts) else ("d", tuple(batch), tuple(parts))
    return None


def _stack(batches: Sequence[Any]) -> Any:
    """The batches (same :func:`_signature`) stacked along a new leading dimension, leaf by leaf."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(batches))
    if isinstance(first, (tuple, list)):
        return type(first)(_stack([b[i] for b in batches]) for i in range(len(first)))
    return {k: _stack([b[k] for b in batches]) for k in first}


class _Loss(nn.Module):
    """``forward(batch) -> scalar loss`` around the model, so ``functional_call`` can swap its parameters."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.batch_loss = batch_loss

    def forward(self, batch: Any) -> torch.Tensor:
        if self.batch_loss is not None:
            return self.batch_loss(self.model, batch)
        x, y = batch
        return self.loss_fn(self.model(x), y)


class BatchedGradients:
    """k workers' gradients of ``loss(params; batch_i)`` at the same parameters, in one ``vmap`` call.

    Args:
        model: the model; its trainable parameters (``requires_grad``), in ``model.parameters()``
            order, are the gradient's coordinates (the order of
            :func:`~robustagg._tensor.flatten` over ``Trainer.params``); frozen parameters and
            buffers are used as they are.
        loss_fn: ``(logits, labels) -> scalar`` (default ``torch.nn.functional.cross_entropy``,
            mean reduction) for ``(x, y)`` batches.
        batch_loss: ``(model, batch) -> scalar`` for any batch (overrides ``loss_fn``).

    The model must pass :func:`check_batchable`; ``vmap`` runs with ``randomness="error"``.
    """

    def __init__(self, model: nn.Module, *, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                 batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None) -> None:
        import torch.nn.functional as F

        self.wrapper = _Loss(model, loss_fn if loss_fn is not None else F.cross_entropy, batch_loss)
        self.names = [f"model.{n}" for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        wrapper = self.wrapper

        def loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
            return torch.func.functional_call(wrapper, params, (batch,))

        self._fn = torch.func.vmap(torch.func.grad_and_value(loss), in_dims=(None, 0), randomness="error")

    def gradients(self, batches: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients on ``batches`` (all of one :func:`_signature`).

        Args:
            batches: k >= 1 batches of identical structure, shapes and dtypes.

        Returns:
            ``(G, losses)``: ``G`` ``(k, d)`` in the parameters' dtype, row i the flattened gradient on
            ``batches[i]``; ``losses`` ``(k,)`` the batch losses.

        Raises:
            RuntimeError: from ``torch.stack`` when the batches differ in shape, or from ``vmap`` (a
                random operation or data-dependent control flow in the forward pass).
        """
        params = {n: p.detach() for n, p in zip(self.names, self.params)}
        grads, losses = self._fn(params, _stack(batches))
        k = len(batches)
        rows = torch.cat([grads[n].reshape(k, -1) for n in self.names], dim=1) if self.names else \
            torch.zeros((k, 0))
        return rows, losses.detach()

    def prefetch(self, trainer: Any, ranks: Sequence[int], step: int) -> dict[int, "Prefetched"]:
        """Draw every hosted worker's next batch in ``ranks`` order and compute their gradients.

        Per worker, exactly what :meth:`Trainer.worker_gradient <robustagg.training.Trainer.worker_gradient>`
        does before its gradient (``trainer``: the :class:`~robustagg.training.Trainer`, not imported
        here: it imports this module): the batch (data position advances; a data poison applies), then
        the worker's RNG stream becomes the process's. Workers are then batched by the batch's
        signature; a batch that is not made of tensors is computed at once by the trainer's
        per-worker gradient, as in the loop.

        Returns:
            ``{rank: Prefetched}`` for every rank of ``ranks``.
        """
        out: dict[int, Prefetched] = {}
        groups: dict[Hashable, list[tuple[int, Any]]] = {}
        for r in ranks:
            batch = trainer.worker_batch(r, step)
            torch.set_rng_state(trainer.worker_rng[r])
            sig = _signature(batch)
            if sig is None:  # the loop's own computation, at the loop's moment
                t0 = time.perf_counter()
                g, loss = trainer._gradient(batch, r)
                trainer.worker_rng[r] = torch.get_rng_state()
                out[r] = Prefetched(step, g, loss, time.perf_counter() - t0)
            else:
                groups.setdefault(sig, []).append((r, batch))
        for members in groups.values():
            t0 = time.perf_counter()
            rows, losses = self.gradients([b for _, b in members])
            share = (time.perf_counter() - t0) / len(members)
            for i, ((r, _), loss) in enumerate(zip(members, losses.tolist())):
                out[r] = Prefetched(step, rows[i].clone(), float(loss), share)
        return out


@dataclass
class Prefetched:
    """One worker's gradient computed ahead by :meth:`BatchedGradients.prefetch`.

    Attributes:
        step: the update it belongs to. gradient: ``(d,)`` flattened, the parameters' dtype.
        loss: the batch loss. seconds: this worker's share of the batched computation's wall time
            (counted in its compute time, the straggler evidence).
    """

    step: int
    gradient: torch.Tensor
    loss: float
    seconds: float

