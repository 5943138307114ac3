"""Learning-rate schedules not in ``torch.optim.lr_scheduler``: linear warm-up, then cosine to zero.

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017 (gradual linear
warm-up, Sec. 2.2) followed by the cosine decay of Loshchilov and Hutter, "SGDR: Stochastic
Gradient Descent with Warm Restarts", ICLR 2017 (Eq. 5, one cycle, no restart, eta_min = 0).

Both are :class:`torch.optim.lr_scheduler.LambdaLR` schedules whose factor is a small callable
object holding plain numbers, so ``state_dict()`` carries everything (LambdaLR saves the
``__dict__`` of callable objects) and a restored schedule continues bit for bit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ..errors import ConfigError

__all__ = ["WarmupCosineFactor", "WarmupCosine", "LENGTH_KEYS", "restore_schedule"]

#: Scheduler attributes that hold a schedule's length: ``T_max`` (``CosineAnnealingLR``),
#: ``total_steps`` (:class:`WarmupCosine`, and its factor).
LENGTH_KEYS = ("T_max", "total_steps")


class WarmupCosineFactor:
    """The multiplier of the base learning rate after ``t`` optimizer steps (``t = 0, 1, ...``).

    Definition, with ``W = warmup_steps``, ``T = total_steps`` and ``L = max(1, T - W)``::

        factor(t) = (t + 1) / W                               for t < W   (linear warm-up)
        factor(t) = 0.5 * (1 + cos(pi * min(t - W, L) / L))   for t >= W  (cosine to 0 at t = W + L)

    so the first step uses ``base / W``, step ``W - 1`` the full rate, and the rate reaches 0
    after ``T`` steps (and stays there). ``W = 0`` is a plain cosine schedule.

    Args:
        warmup_steps: W >= 0. total_steps: T >= 0 (the run's length; a warm-up longer than the run
            is truncated, never an error, so short smoke runs of a long schedule work).

    Raises:
        ConfigError: a negative ``warmup_steps`` or ``total_steps``.
    """

    def __init__(self, warmup_steps: int, total_steps: int) -> None:
        if int(warmup_steps) < 0 or int(total_steps) < 0:
            raise ConfigError(f"scheduler.warmup_steps and scheduler.total_steps must be >= 0; got {warmup_steps} "
                              f"and {total_steps}.")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def __call__(self, t: int) -> float:
        w = self.warmup_steps
        if t < w:
            return (t + 1) / w
        span = max(1, self.total_steps - w)
        return 0.5 * (1.0 + math.cos(math.pi * min(t - w, span) / span))


class WarmupCosine(LambdaLR):
    """Linear warm-up for ``warmup_steps`` steps, then cosine decay to 0 at ``total_steps``
    (see :class:`WarmupCosineFactor` for the formula and sources).

    Args:
        optimizer: any ``torch.optim`` optimizer (every parameter group is scaled by the same factor).
        warmup_steps: W >= 0 steps of linear warm-up.
        total_steps: T, the run's length in optimizer steps (the config interpolates
            ``${trainer.steps}``).
        last_epoch: as in LambdaLR (``-1``: start from step 0).

    Raises:
        ConfigError: a negative ``warmup_steps`` or ``total_steps``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> s = WarmupCosine(opt, warmup_steps=2, total_steps=6)
        >>> lrs = []
        >>> for _ in range(7):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 4)); opt.step(); s.step()
        >>> lrs
        [0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, 0.0]
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, last_epoch: int = -1) -> None:
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        super().__init__(optimizer, WarmupCosineFactor(warmup_steps, total_steps), last_epoch=last_epoch)

    def setting_notes(self) -> list[str]:
        """A warm-up as long as the run or longer (truncated, never an error, so that a short smoke run
        of a long schedule works): the rate never leaves the warm-up and peaks at
        ``total_steps / warmup_steps`` of the base rate. One line, or none.
        """
        w, t = self.warmup_steps, self.total_steps
        if w == 0 or w < t:
            return []
        return [f"scheduler.warmup_steps={w} is not shorter than the run (scheduler.total_steps={t}, from "
                f"trainer.steps): the learning rate never leaves the linear warm-up and peaks at {t}/{w} of "
                f"optimizer.lr. Set scheduler.warmup_steps below {t} (e.g. {max(1, t // 10)}), or scheduler=cosine."]


def restore_schedule(scheduler: Any, state: dict[str, Any]) -> list[str]:
    """Load ``state`` into ``scheduler``, keeping the schedule length the scheduler was built with.

    A run extended on resume (``trainer.steps`` 40 -> 80 with ``T_max: ${trainer.steps}``) builds its
    scheduler with the new length, and ``load_state_dict`` would put the checkpoint's back (and
    cosine's recursive update would then stay at ``eta_min`` for good). Here the length attributes
    (:data:`LENGTH_KEYS`) that differ keep the built values, and the optimizer's learning rates are
    set to the schedule's closed form at the restored step: from the checkpoint's step on, the run
    follows the longer schedule exactly as a run of that length would. When no length differs (every
    plain resume) this is ``scheduler.load_state_dict(state)`` and nothing else, bit for bit.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler (already built on the restored optimizer).
        state: its ``state_dict()`` from the checkpoint.

    Returns:
        the length attributes that kept the built value (empty for a plain resume).
    """
    built = {k: getattr(scheduler, k) for k in LENGTH_KEYS if hasattr(scheduler, k)}
    scheduler.load_state_dict(state)
    changed = [k for k, v in built.items() if getattr(scheduler, k) != v]
    if not changed:
        return []
    for k in changed:
        setattr(scheduler, k, built[k])
        for fn in getattr(scheduler, "lr_lambdas", ()):  # WarmupCosine's factor holds the length too
            if hasattr(fn, k):
                setattr(fn, k, built[k])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # get_lr() outside step(): the closed form is wanted here
        closed = scheduler._get_closed_form_lr() if hasattr(scheduler, "_get_closed_form_lr") else scheduler.get_lr()
    for group, lr in zip(scheduler.optimizer.param_groups, closed):
        group["lr"] = float(lr)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return changed
