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
  differed by at most a few float32 ulps of the largest coordinate (relative 4.4e-7 at most); in
  float64 by at most 3e-16 relative. It is harmless for the experiments: it is float32 rounding
  itself, about 3e6 times smaller than the range of the honest workers' gradients that the
  robust rule works on, and every rank applies the same aggregate, so ranks never disagree. Runs
  with the flag on and off are different experiments, so the flag is part of the run's identity.
- *Shapes*: workers whose batches have the same structure, shapes and dtypes are batched together
  (one ``vmap`` per group; an uneven last batch of an :class:`~robustagg.training.IterableSource`
  forms its own group); a batch holding anything other than tensors (in tuples, lists or dicts)
  goes through the trainer's ordinary per-worker gradient.

**What it refuses** (:func:`check_batchable`, before launch in the app and in the trainer's
constructor): BatchNorm (running statistics updated in place, and batch statistics that ``vmap``
would have to keep apart), InstanceNorm with running statistics, dropout and other random layers
(per-worker RNG streams), ``precision`` other than ``32`` (autocast and the per-worker fp16 loss
scaler's retries), and protocols whose submissions are not one plain gradient per worker at the
current parameters (``local``: sequential local steps; ``redundant``: replicas are compared bit for
bit across processes, which may batch different numbers of workers). Data-dependent control flow
in the model's forward makes ``vmap`` raise; the app's dry run turns that into the same refusal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["BatchedGradients", "Prefetched", "batchable_problems", "check_batchable", "KEY"]

#: The configuration key of the flag (named in every refusal).
KEY = "trainer.batched_gradients"
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


def check_batchable(model: nn.Module, *, protocol: Any = None, precision: Any = "32",
                    example: Any = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                    batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None) -> None:
    """Refuse a setting whose per-worker gradients cannot be batched (call it before launch).

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
    from .precision import Precision, parse_precision

    problems = [f"the model's {p}" for p in batchable_problems(model)]
    name = getattr(protocol, "name", "dsgd") if protocol is not None else "dsgd"
    if protocol is not None and getattr(protocol, "batched", None) is None:
        problems.append(f"protocol={name} does not submit one plain gradient per worker at the current parameters "
                        "(local rounds take sequential local steps; redundant replicas are compared bit for bit "
                        "across processes that may batch different numbers of workers); dsgd and async do")
    if parse_precision(precision) is not Precision.full:
        problems.append(f"trainer.precision={getattr(precision, 'value', precision)}: autocast and the per-worker fp16 "
                        "loss scaler are not batched; use trainer.precision=32")
    if not problems and example is not None:
        model.train()
        try:
            BatchedGradients(model, loss_fn=loss_fn, batch_loss=batch_loss).gradients([example, example])
        except Exception as exc:  # vmap's own errors (randomness, data-dependent control flow) are RuntimeErrors
            problems.append(f"a dry run of torch.func.vmap over the model failed: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{KEY}=true cannot batch this run's per-worker gradients with torch.func.vmap:\n{lines}\n"
                          f"Fix: {_FIX}, or remove what is listed (e.g. model.dropout=0, a GroupNorm model, "
                          "protocol=dsgd).")


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

