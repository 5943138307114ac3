"""Mimic (Karimireddy, He, Jaggi, ICLR 2022): every Byzantine worker copies one chosen honest worker."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError, ShapeError

from ._stats import norm64, randn64
from .base import Attack, Knowledge
from .registry import register

__all__ = ["Mimic"]


def _power_step(x: torch.Tensor, mu: torch.Tensor, z: torch.Tensor) -> Optional[torch.Tensor]:
    """``v = sum_i (x_i - mu) <x_i - mu, z>`` normalised; ``None`` when ``v = 0`` (no spread along z)."""
    c = x - mu
    v = c.T @ (c @ z)
    nv = norm64(v)
    return None if nv == 0.0 or nv != nv else v / nv


@register("mimic")
class Mimic(Attack):
    r"""Mimic: all Byzantine rows copy the honest worker most aligned with the top honest-variance direction.

    Definition: with honest rows ``x_1..x_h`` of step ``t`` (0-based count of calls since the last
    :meth:`reset`):

    - warm-up (``t < warmup``): a running estimate of the top eigenvector of the honest covariance.
      At ``t = 0``: ``mu = x̄_H``, ``z = v(z_0)`` with ``z_0 ~ N(0, I)`` from ``generator``
      (normalised); for ``t >= 1``: ``mu <- (t mu + x̄_H)/(t + 1)``,
      ``z <- normalise((t z + v(z))/(t + 1))``, where
      ``v(z) = normalise(sum_i (x_i - mu) <x_i - mu, z>)`` is one power-iteration step on the
      centred rows (``z`` is kept when ``v`` is zero, e.g. zero honest variance). The target is
      ``i_t = argmax_i <z, x_i>`` (lowest index on ties).
    - after the warm-up the target ``i*`` (the last warm-up choice) is fixed and every Byzantine
      row is ``x_{i*}`` of the current step.

    State (explicit, :meth:`state_dict`): ``step``, ``mean``, ``direction`` (float64 ``(d,)``) and
    ``index``. The index refers to the order of the honest rows passed in, which must be stable
    across steps (e.g. by rank).

    Knowledge: ``honest`` (omniscient).

    Args:
        warmup: number of warm-up steps ``>= 1``, default 1.

    Shape: ``honest (h, d) -> (f, d)``; a copy of one honest row.

    Raises:
        ConfigError: ``warmup`` out of range; a state of another attack.
        ShapeError: ``d`` differs from the state's, or the fixed index is not below ``h`` (call
            :meth:`reset` when the honest set changes).
        NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The authors' public code initialises ``z`` from a fixed seed; here it comes from
        ``generator`` (``None``: the global torch RNG). Its target is the argmax of the uncentred
        inner product ``<z, x_i>``, as here.

    Example:
        >>> import torch, attacks
        >>> honest = torch.tensor([[0.0, 1.0], [0.0, -1.0], [5.0, 0.0], [-5.0, 0.0]])
        >>> m = attacks.Mimic(warmup=2)
        >>> g = torch.Generator().manual_seed(0)
        >>> out = m(honest, 2, generator=g)
        >>> m.state_dict()["index"] in (2, 3), bool((out == honest[m.state_dict()["index"]]).all())
        (True, True)

    References:
        Karimireddy, He, Jaggi, "Byzantine-robust learning on heterogeneous datasets via
        bucketing", ICLR 2022.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.HONEST
    paper = "Karimireddy, He, Jaggi, ICLR 2022"
    stateful = True

    def __init__(self, *, warmup: int = 1) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"Mimic: warmup must be an integer >= 1; got {warmup!r}.")
        self.warmup = warmup
        self.reset()

    def reset(self) -> None:
        """Forget the warm-up (the next call is step 0 again)."""
        self.step = 0
        self.mean: Optional[torch.Tensor] = None
        self.direction: Optional[torch.Tensor] = None
        self.index: Optional[int] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        h, d = honest.shape
        if self.direction is not None and self.direction.shape[0] != d:
            raise ShapeError(f"Mimic: the state has d={self.direction.shape[0]} but honest has d={d}; call reset().")
        if self.step < self.warmup:
            x = honest.to(torch.float64)
            cur = x.mean(dim=0)
            if self.direction is None or self.mean is None:
                self.mean = cur
                z = randn64((d,), generator, honest.device)
                nz = norm64(z)
                z = torch.ones_like(z) / d ** 0.5 if nz == 0.0 else z / nz
                v0 = _power_step(x, self.mean, z)
                z = z if v0 is None else v0
            else:
                t = self.step
                self.mean = (t * self.mean.to(honest.device) + cur) / (t + 1)
                z = self.direction.to(honest.device)
                v = _power_step(x, self.mean, z)
                if v is not None:
                    w = (t * z + v) / (t + 1)
                    nw = norm64(w)
                    z = z if nw == 0.0 else w / nw
            self.direction = z
            self.index = int(torch.argmax(x @ z))
        assert self.index is not None
        if self.index >= h:
            raise ShapeError(f"Mimic: the fixed target index {self.index} is not below h={h} honest rows; keep the "
                             "honest rows in a stable order or call reset().")
        self.step += 1
        return honest[self.index].to(torch.float64)

    def state_dict(self) -> dict[str, Any]:
        """``{"attack": "mimic", "step", "mean", "direction", "index"}`` (tensors cloned)."""
        return {"attack": self.name, "step": self.step,
                "mean": None if self.mean is None else self.mean.clone(),
                "direction": None if self.direction is None else self.direction.clone(),
                "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        step, index = state.get("step"), state.get("index")
        if not isinstance(step, int) or step < 0 or not (index is None or isinstance(index, int)):
            raise ConfigError(f"Mimic: malformed state (step={step!r}, index={index!r}).")
        self.step, self.index = step, index
        self.mean = None if state.get("mean") is None else torch.as_tensor(state["mean"]).clone()
        self.direction = None if state.get("direction") is None else torch.as_tensor(state["direction"]).clone()

    def _params(self) -> dict[str, Any]:
        return {"warmup": self.warmup}
