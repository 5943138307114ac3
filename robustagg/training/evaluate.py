"""Held-out evaluation: accuracy, loss, per-class and worst-class accuracy, backdoor attack success rate."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ShapeError

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch_size: int = 2048, *, trigger: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
             target: Optional[int] = None) -> dict[str, float]:
    """Top-1 accuracy, mean cross-entropy, accuracy per class on ``(x, y)``; optionally the backdoor's success rate.

    Definition: ``test/acc`` = fraction of examples whose arg-max logit equals the label;
    ``test/loss`` = mean cross-entropy (nats); ``test/acc_per_class/c`` = accuracy on the examples
    of class ``c`` (``nan`` for a class absent from ``y``); ``test/worst_class_acc`` = the lowest
    per-class accuracy over the classes present. With a backdoor (``trigger`` and ``target``):
    ``test/asr`` = the attack success rate, the fraction of the examples whose true label is not
    ``target``, passed through ``trigger`` (the full trigger stamped), that the model classifies as
    ``target`` (``nan`` when every label is the target). Clean accuracy is unchanged by it
    (Gu et al., BadNets, 2017; Xie et al., DBA, ICLR 2020).

    Args:
        model: maps a batch of ``x`` to ``(b, num_classes)`` logits; evaluated in ``eval()`` mode
            and put back in its previous mode.
        x: inputs ``(N, ...)``; y: int64 labels ``(N,)`` in ``[0, num_classes)``.
        num_classes: number of classes C.
        batch_size: evaluation batch size (no effect on the result).
        trigger: ``x_b -> x_b`` stamping the trigger on a batch (same shape), e.g.
            ``attacks.Backdoor.stamp``; ``None`` (default): no ``test/asr``.
        target: the backdoor's target class in ``[0, num_classes)``; required with ``trigger``.

    Returns:
        a flat dict of floats with the keys above.

    Raises:
        ShapeError: ``x`` and ``y`` disagree in length, or the set is empty; ``trigger`` changed
            the batch's shape.
        ConfigError: only one of ``trigger`` and ``target`` given, or ``target`` out of range.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> _ = torch.nn.init.eye_(model.weight)   # predicts the arg-max coordinate
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]]); y = torch.tensor([0, 1, 1])
        >>> r = evaluate(model, x, y, 2)
        >>> r["test/acc"], r["test/acc_per_class/1"], r["test/worst_class_acc"]  # 2/3, 1/2, min(1, 1/2)
        (0.6666666666666666, 0.5, 0.5)
        >>> shift = lambda xb: xb + torch.tensor([0.0, 5.0])   # a "trigger" that makes class 1 win
        >>> evaluate(model, x, y, 2, trigger=shift, target=1)["test/asr"]  # 1 example not of class 1: hit
        1.0
    """
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ShapeError(f"x and y must be non-empty with the same length; got {x.shape[0]} and {y.shape[0]}.")
    if (trigger is None) != (target is None):
        raise ConfigError("evaluate: pass both trigger= and target= for the attack success rate, or neither.")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int)
                               or not 0 <= target < num_classes):
        raise ConfigError(f"evaluate: target must be a class in [0, {num_classes}); got {target!r}.")
    was_training = model.training
    model.eval()
    correct = torch.zeros(num_classes, dtype=torch.float64)
    count = torch.zeros(num_classes, dtype=torch.float64)
    loss_sum = 0.0
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        logits = model(xb)
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        hit = (logits.argmax(dim=1) == yb).double().cpu()
        yc = yb.cpu()
        correct.index_add_(0, yc, hit)
        count.index_add_(0, yc, torch.ones_like(hit))
    model.train(was_training)
    out = {"test/acc": float(correct.sum() / count.sum()), "test/loss": loss_sum / x.shape[0]}
    per = [float(correct[c] / count[c]) if count[c] > 0 else math.nan for c in range(num_classes)]
    for c, a in enumerate(per):
        out[f"test/acc_per_class/{c}"] = a
    present = [a for a in per if not math.isnan(a)]
    out["test/worst_class_acc"] = min(present)
    if trigger is not None and target is not None:
        out["test/asr"] = _asr(model, x[y != target], target, trigger, batch_size)
        model.train(was_training)
    return out


def _asr(model: nn.Module, x: torch.Tensor, target: int, trigger: Callable[[torch.Tensor], torch.Tensor],
         batch_size: int) -> float:
    """Fraction of ``trigger(x)`` classified as ``target`` (``nan`` for an empty ``x``), in eval mode."""
    if x.shape[0] == 0:
        return math.nan
    model.eval()
    hits = 0
    for start in range(0, x.shape[0], batch_size):
        xb = x[start:start + batch_size]
        xt = trigger(xb)
        if not isinstance(xt, torch.Tensor) or xt.shape != xb.shape:
            got = tuple(xt.shape) if isinstance(xt, torch.Tensor) else type(xt).__name__
            raise ShapeError(f"evaluate: trigger must keep the batch shape {tuple(xb.shape)}; got {got}.")
        hits += int((model(xt).argmax(dim=1) == target).sum())
    return hits / x.shape[0]
