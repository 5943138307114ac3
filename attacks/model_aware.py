"""Attacks that read the current model instead of the honest rows: MPAF and PoisonedFL.

Both know nothing about the honest workers (knowledge ``none``): they read the global model
parameters ``w_t`` (``parameters=``, which every worker of data-parallel training holds, as every
federated client receives the global model) and keep state across steps. Gradient convention: the
defender applies ``w_{t+1} = w_t - lr * aggregate``, so a submission ``b`` pulls the model along
``-b``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from robustagg.errors import ConfigError, ShapeError

from .base import Knowledge, ModelAwareAttack, finite_float, positive_float
from .registry import register

__all__ = ["MPAF", "PoisonedFL"]


def _seed(value: object, attack: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attack}: seed must be an integer >= 0; got {value!r}.")
    return value


def _vector(state: dict[str, Any], key: str, attack: str) -> Optional[torch.Tensor]:
    v = state.get(key)
    if v is None:
        return None
    if not isinstance(v, torch.Tensor) or v.dim() != 1:
        raise ConfigError(f"{attack}: malformed state: {key} must be a 1-D tensor or None; got {type(v).__name__}.")
    return v.detach().to(torch.float64).clone()


def _check_d(v: Optional[torch.Tensor], d: int, attack: str) -> None:
    if v is not None and v.shape[0] != d:
        raise ShapeError(f"{attack}: the state has d={v.shape[0]} but the model has d={d} parameters; call reset().")


@register("mpaf")
class MPAF(ModelAwareAttack):
    r"""MPAF: fake clients drag the global model toward an attacker-chosen base model.

    Definition: at every step, with the current parameters ``w_t`` (float64 ``(d,)``), every
    Byzantine row is ``b = scale * (w_t - w_base)``: the optimizer's step ``-lr * b`` points from
    ``w_t`` to the base model ``w_base``. The paper's fake clients send the model update
    ``lambda * (w' - w_t)`` toward a low-accuracy base model ``w'``; this is its gradient form.
    ``w_base`` is drawn once, at the first call, as ``base_std * N(0, I_d)`` from a generator
    seeded with ``seed`` (float64, on the CPU), so every Byzantine process draws the same base
    model; ``base_std = 0`` gives the zero model.

    State (explicit, :meth:`state_dict`): ``base`` (float64 ``(d,)`` or ``None`` before the first call).

    Knowledge: ``none`` about the other workers; reads the current model (``parameters=``).

    Args:
        scale: the paper's ``lambda``, positive finite, default 10.0 (the paper uses a large
            factor to dominate averaging; robust rules clip or discard large rows, so it matters
            less against them).
        base_std: standard deviation ``>= 0`` of the random base model, default 0.1.
        seed: seed ``>= 0`` of the base model, default 0.

    Shape: ``honest (h, d), parameters (d,) -> (f, d)``.

    Raises:
        ConfigError: a parameter out of range; ``parameters`` missing; a malformed state.
        ShapeError: ``parameters`` not ``(d,)``; ``d`` differs from the state's (call :meth:`reset`).

    Example:
        >>> import torch, attacks
        >>> a = attacks.MPAF(scale=2.0, base_std=0.0)   # base model = 0
        >>> a(torch.zeros(3, 2), 1, parameters=torch.tensor([1.0, -0.5]))
        tensor([[ 2., -1.]])

    References:
        Cao, Gong, "MPAF: model poisoning attacks to federated learning based on fake clients",
        CVPR Workshops 2022.
    """

    knowledge = Knowledge.NONE
    paper = "Cao, Gong, CVPR Workshops 2022"
    stateful = True

    def __init__(self, *, scale: float = 10.0, base_std: float = 0.1, seed: int = 0) -> None:
        self.scale = positive_float(scale, "scale", "MPAF")
        self.base_std = finite_float(base_std, "base_std", "MPAF")
        if self.base_std < 0:
            raise ConfigError(f"MPAF: base_std must be >= 0; got {base_std!r}.")
        self.seed = _seed(seed, "MPAF")
        self.reset()

    def reset(self) -> None:
        """Forget the base model (the next call draws it again, the same from ``seed``)."""
        self.base: Optional[torch.Tensor] = None

    def _craft_model(self, honest: torch.Tensor, f: int, w: torch.Tensor, *, own: Optional[torch.Tensor],
                     generator: Optional[torch.Generator]) -> torch.Tensor:
        d = w.shape[0]
        _check_d(self.base, d, "MPAF")
        if self.base is None:
            g = torch.Generator().manual_seed(self.seed)
            self.base = self.base_std * torch.randn(d, generator=g, dtype=torch.float64)
        return self.scale * (w - self.base.to(w.device))

    def state_dict(self) -> dict[str, Any]:
        """``{"attack": "mpaf", "base"}`` (tensor cloned)."""
        return {"attack": self.name, "base": None if self.base is None else self.base.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base = _vector(state, "base", "MPAF")

    def _params(self) -> dict[str, Any]:
        return {"scale": self.scale, "base_std": self.base_std, "seed": self.seed}


@register("poisoned_fl")
class PoisonedFL(ModelAwareAttack):
    r"""PoisonedFL: one fixed random sign direction, kept across rounds, sized like the model's last move.

    Definition: a sign vector ``s in {-1, +1}^d`` is drawn once (first call; Rademacher from a
    generator seeded with ``seed``) and kept. At step ``t`` with parameters ``w_t``, every
    Byzantine row is

    ``b_t = c_t * s ⊙ m_t``, ``m_t = |w_t - w_{t-1}| / lr``

    (the per-coordinate size of the model's last move, in gradient units; ``lr`` is the server
    learning rate the attacker assumes; at the first call ``m = init_magnitude``). The optimizer's
    step ``-lr * b`` pushes the model along ``-s`` in every round, so the pushes add up instead of
    cancelling across rounds. ``c_t`` starts at ``scale`` and is adapted every ``period`` calls:
    with ``D = w_t - w_{t - period}`` the model's move over the period, the alignment is the
    fraction of coordinates with ``sign(D_j) = -s_j`` (zero moves count as not aligned); when it is
    below ``threshold`` the attack is being filtered out and ``c <- decay * c`` (smaller rows pass
    the defence more easily); otherwise ``c`` is kept.

    State (explicit, :meth:`state_dict`): ``step``, ``sign``, ``c``, ``previous`` (``w_{t-1}``) and
    ``anchor`` (``w`` at the start of the current period) as float64 ``(d,)``.

    Knowledge: ``none`` about the other workers; reads the current model (``parameters=``).

    Args:
        scale: initial ``c_0 > 0``, default 1.0.
        lr: the server learning rate the attacker assumes (``> 0``), default 0.1 (set it to the
            trainer's, e.g. ``${trainer.lr}`` in Hydra).
        period: calls between two adaptations of ``c`` (``>= 1``), default 10.
        decay: factor in ``(0, 1]`` applied to ``c`` when the alignment is low, default 0.7.
        threshold: alignment below which ``c`` decays, in ``[0, 1]``, default 0.5 (chance level).
        init_magnitude: ``m`` at the first call (``> 0``), default 0.01.
        seed: seed ``>= 0`` of the sign vector, default 0.

    Shape: ``honest (h, d), parameters (d,) -> (f, d)``.

    Raises:
        ConfigError: a parameter out of range; ``parameters`` missing; a malformed state.
        ShapeError: ``parameters`` not ``(d,)``; ``d`` differs from the state's (call :meth:`reset`).

    Note:
        The paper's magnitude vector is the last global model update, and its scaling factor is
        decreased when the aggregated updates over the last rounds do not follow the sign vector;
        the threshold, decay and period defaults here are this implementation's choices.

    Example:
        >>> import torch, attacks
        >>> a = attacks.PoisonedFL(scale=2.0, lr=0.5, init_magnitude=0.25)
        >>> b0 = a(torch.zeros(3, 2), 1, parameters=torch.tensor([1.0, 1.0]))
        >>> s = a.state_dict()["sign"]
        >>> bool(torch.equal(b0[0], 2.0 * 0.25 * s))    # first call: c * s * init_magnitude
        True
        >>> b1 = a(torch.zeros(3, 2), 1, parameters=torch.tensor([0.5, 1.25]))
        >>> bool(torch.equal(b1[0], 2.0 * s * torch.tensor([1.0, 0.5], dtype=torch.float64)))  # |dw| / lr
        True

    References:
        Xie, Fang, Gong, "Model poisoning attacks to federated learning via multi-round
        consistency", CVPR 2025.
    """

    knowledge = Knowledge.NONE
    paper = "Xie, Fang, Gong, CVPR 2025"
    stateful = True

    def __init__(self, *, scale: float = 1.0, lr: float = 0.1, period: int = 10, decay: float = 0.7,
                 threshold: float = 0.5, init_magnitude: float = 0.01, seed: int = 0) -> None:
        self.scale = positive_float(scale, "scale", "PoisonedFL")
        self.lr = positive_float(lr, "lr", "PoisonedFL")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ConfigError(f"PoisonedFL: period must be an integer >= 1; got {period!r}.")
        self.period = period
        self.decay = positive_float(decay, "decay", "PoisonedFL")
        if self.decay > 1:
            raise ConfigError(f"PoisonedFL: decay must be in (0, 1]; got {decay!r}.")
        self.threshold = finite_float(threshold, "threshold", "PoisonedFL")
        if not 0 <= self.threshold <= 1:
            raise ConfigError(f"PoisonedFL: threshold must be in [0, 1]; got {threshold!r}.")
        self.init_magnitude = positive_float(init_magnitude, "init_magnitude", "PoisonedFL")
        self.seed = _seed(seed, "PoisonedFL")
        self.reset()

    def reset(self) -> None:
        """Forget the state (the next call is the first again; the sign vector is redrawn from ``seed``)."""
        self.step = 0
        self.c = self.scale
        self.sign: Optional[torch.Tensor] = None
        self.previous: Optional[torch.Tensor] = None
        self.anchor: Optional[torch.Tensor] = None
        #: The alignment measured at the last adaptation (``None`` before the first).
        self.last_alignment: Optional[float] = None

    def _craft_model(self, honest: torch.Tensor, f: int, w: torch.Tensor, *, own: Optional[torch.Tensor],
                     generator: Optional[torch.Generator]) -> torch.Tensor:
        d = w.shape[0]
        for v in (self.sign, self.previous, self.anchor):
            _check_d(v, d, "PoisonedFL")
        if self.sign is None:
            g = torch.Generator().manual_seed(self.seed)
            self.sign = torch.randint(0, 2, (d,), generator=g).to(torch.float64) * 2.0 - 1.0
        s = self.sign.to(w.device)
        if self.anchor is None:
            self.anchor = w.clone()
        elif self.step % self.period == 0:
            move = w - self.anchor.to(w.device)
            aligned = float(((torch.sign(move) == -s) & (move != 0)).double().mean())
            self.last_alignment = aligned
            if aligned < self.threshold:
                self.c *= self.decay
            self.anchor = w.clone()
        if self.previous is None:
            m = torch.full_like(w, self.init_magnitude)
        else:
            m = (w - self.previous.to(w.device)).abs() / self.lr
        self.previous = w.clone()
        self.step += 1
        return self.c * s * m

    def state_dict(self) -> dict[str, Any]:
        """``{"attack": "poisoned_fl", "step", "c", "sign", "previous", "anchor"}`` (tensors cloned)."""
        def cl(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if v is None else v.clone()

        return {"attack": self.name, "step": self.step, "c": self.c, "sign": cl(self.sign),
                "previous": cl(self.previous), "anchor": cl(self.anchor), "last_alignment": self.last_alignment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        step, c = state.get("step"), state.get("c")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or isinstance(c, bool) \
                or not isinstance(c, (int, float)) or not c > 0:
            raise ConfigError(f"PoisonedFL: malformed state (step={step!r}, c={c!r}).")
        self.step, self.c = step, float(c)
        self.sign = _vector(state, "sign", "PoisonedFL")
        self.previous = _vector(state, "previous", "PoisonedFL")
        self.anchor = _vector(state, "anchor", "PoisonedFL")
        la = state.get("last_alignment")
        self.last_alignment = None if la is None else float(la)

    def _params(self) -> dict[str, Any]:
        return {"scale": self.scale, "lr": self.lr, "period": self.period, "decay": self.decay,
                "threshold": self.threshold, "init_magnitude": self.init_magnitude, "seed": self.seed}
