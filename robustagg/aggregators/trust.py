"""Trust-weighted rules: FLTrust (needs a trusted server update) and FoolsGold (stateful history)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError, ShapeError
from ..functional import trust as T
from ..functional.cosine import combine
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator, positive_float

__all__ = ["FLTrust", "FoolsGold"]


@register("fltrust")
class FLTrust(Aggregator):
    r"""FLTrust: weigh each update by its (ReLU-clipped) cosine with a trusted server update.

    Definition (Cao, Fang, Liu, Gong, "FLTrust: Byzantine-robust federated learning via trust
    bootstrapping", NDSS 2021, Eq. 4-6): with ``g0`` the server's update on its small clean root
    data set, ``TS_i = max(0, cos(x_i, g0))`` and the output
    ``sum_i TS_i (||g0|| / ||x_i||) x_i / sum_i TS_i`` (zero when every ``TS_i`` is 0).

    Assumption: the server holds trusted data and computes ``g0`` itself, with the same model.
    No bound on ``f`` is needed (the output's norm is at most ``||g0||`` whatever the clients
    send); the protection is only as good as the root set: an unrepresentative root set (another
    label distribution than the clients') gives honest updates low or zero trust, and the rule
    then follows the root data rather than the clients (Cao et al., Sec. 6, root-set bias).

    Requirement: ``n >= 1`` client row (``n >= 2`` rows with ``root="last_row"``). No (f, kappa)
    bound.

    Args:
        root: where ``g0`` comes from. ``"given"`` (default): call :meth:`set_trusted` before each
            call (the value is used once, then cleared, so a stale ``g0`` is never reused; the
            trainer does so with ``server.root_samples=K``);
            ``"last_row"``: the last row of ``x`` is ``g0`` and the other rows are the clients.
        f: declared Byzantine bound (informational: not part of the requirement).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``; :meth:`set_trusted` takes a ``(d,)`` tensor.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: an unknown ``root``; a call in ``"given"`` mode without :meth:`set_trusted`.
        ShapeError: a trusted update whose length is not ``d`` or that is not finite.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-5.0, 0.0]], dtype=torch.float64)
        >>> rule = ra.FLTrust()
        >>> rule.set_trusted(torch.tensor([1.0, 1.0], dtype=torch.float64))
        >>> rule(x)  # each cos = 1/sqrt(2); rows rescaled to norm sqrt(2); the third gets trust 0
        tensor([0.7071, 0.7071], dtype=torch.float64)
    """

    display_name = "FLTrust"
    paper = "Cao et al., NDSS 2021"
    translation_equivariant = False
    breakdown_point = "none needed: ‖F(X)‖ ≤ ‖g0‖"

    def __init__(self, *, root: str = "given", f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        if root not in ("given", "last_row"):
            raise ConfigError(f"FLTrust: root must be 'given' (call set_trusted(g0) before each call) or "
                              f"'last_row' (the last row of x is g0); got {root!r}.")
        self.root = root
        self.permutation_invariant = root == "given"  # type: ignore[misc]
        # "given": the Gram pass sees NaN/inf rows (g0 was checked by set_trusted); with
        # "last_row" a separate check names the rows of x, the trusted row included.
        self.gram_checks_finite = root == "given"  # type: ignore[misc]
        self.trusted: torch.Tensor | None = None

    @property
    def requirement(self) -> Requirement:
        if self.root == "last_row":
            return Requirement("FLTrust", "n >= 2", lambda n, f: n >= 2, self.paper, breakdown=self.breakdown_point)
        return Requirement("FLTrust", "n >= 1", lambda n, f: n >= 1, self.paper, breakdown=self.breakdown_point)

    def set_trusted(self, g0: torch.Tensor) -> None:
        """Give the server's update ``g0`` (``(d,)``, finite) for the next call only.

        Raises:
            ShapeError: ``g0`` is not 1-D or holds NaN/inf.
        """
        if not isinstance(g0, torch.Tensor) or g0.dim() != 1 or not g0.is_floating_point():
            raise ShapeError(f"FLTrust: the trusted update must be a (d,) floating tensor; got "
                             f"{getattr(g0, 'shape', type(g0).__name__)}.")
        if not bool(torch.isfinite(g0).all()):
            raise ShapeError("FLTrust: the trusted update holds NaN or inf; recompute it on the root data.")
        self.trusted = g0.detach()

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.root == "last_row":
            return x[:-1], x[-1]
        if self.trusted is None:
            raise ConfigError("FLTrust: no trusted server update; call rule.set_trusted(g0) with the server's "
                              "update on its root data before each call (trainer option server.root_samples), or "
                              "build FLTrust(root='last_row') and append g0 as the last row.")
        if self.trusted.numel() != x.shape[1]:
            raise ShapeError(f"FLTrust: the trusted update has {self.trusted.numel()} entries but the submissions "
                             f"have d={x.shape[1]}.")
        return x, self.trusted

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        clients, g0 = self._split(x)
        out = T.fltrust(clients, g0)
        if self.root == "given":
            self.trusted = None
        return out

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        clients, g0 = self._split(x)
        a = T.fltrust_coefficients(clients, g0)
        return torch.cat([a, a.new_zeros(1)]) if self.root == "last_row" else a

    def reset(self) -> None:
        """Drop a trusted update not used yet."""
        self.trusted = None

    def _params(self) -> dict[str, Any]:
        return {"root": self.root, "f": self.f}


@register("foolsgold")
class FoolsGold(Aggregator):
    r"""FoolsGold: down-weight workers whose update *histories* are too similar (sybils), a stateful rule.

    Definition (Fung, Yoon, Beschastnikh, "The limitations of federated learning in sybil
    settings", RAID 2020, Alg. 1): the history ``H_i`` is the sum of worker ``i``'s rows so far
    (this call's included); from the cosines ``cs_ij = cos(H_i, H_j)`` with pardoning and a logit
    (:func:`robustagg.functional.trust.foolsgold_alpha`) each worker gets ``alpha_i`` in [0, 1];
    the output is ``sum_i alpha_i x_i / sum_i alpha_i`` (zero when every alpha is 0).

    Requirement: ``n >= f + 1`` (at least one honest worker; the number of sybils is not bounded
    otherwise). It assumes honest workers' histories are not near-identical (non-IID data): with
    IID honest data they are, and FoolsGold down-weights the honest workers too. No (f, kappa)
    bound.

    Args:
        kappa: confidence of the logit (> 0). Default 1.
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    State: the ``(n, d)`` histories in the input's dtype (:meth:`state_dict`, checkpointed with the
    run; ``n d`` numbers). Row ``i`` must be the same worker at every call: when ``n`` changes
    (a dropped row) the history restarts (counted in :attr:`restarts`) rather than mix workers up.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``kappa`` out of range; a stored history of another ``d``.

    Note:
        The paper sums ``alpha_i x_i``; here the sum is divided by ``sum_i alpha_i``, a weighted mean,
        so that the step size does not grow with the number of trusted workers. The paper's
        optional feature-importance weighting of the output layer is not applied (the rule sees a
        flat vector). A worker's top similarity ``v_i`` counts its own cosine as 0, as the authors'
        code does (``cs = cosine_similarity(H) - I``), so ``v_i >= 0`` and a worker whose history
        points away from every other keeps weight 1; a maximum over the other workers only makes
        ``v_i`` negative, and pardoning by ``v_i / v_j < 0`` then turns that worker's negative
        similarities positive and its weight to 0. Not translation equivariant, not unanimous
        (identical rows are all taken for sybils: zero update).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [5.0, 5.0]], dtype=torch.float64)
        >>> ra.FoolsGold(f=2)(x)  # the two identical rows get alpha 0; the others are averaged
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    display_name = "FoolsGold"
    paper = "Fung, Yoon, Beschastnikh, RAID 2020"
    translation_equivariant = False
    breakdown_point = "no bound on f (sybils); needs one honest worker"

    def __init__(self, *, kappa: float = 1.0, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.kappa = positive_float(kappa, "kappa", "FoolsGold")
        self.history: torch.Tensor | None = None
        #: Times the history restarted because ``n`` changed (a dropped or added row).
        self.restarts = 0

    @property
    def requirement(self) -> Requirement:
        return linear("FoolsGold", 1, 1, self.paper, breakdown=self.breakdown_point)

    def _history(self, x: torch.Tensor) -> torch.Tensor | None:
        h = self.history
        if h is None:
            return None
        if h.shape[1] != x.shape[1]:
            raise ConfigError(f"FoolsGold: stored history has d={h.shape[1]} but the submissions have d={x.shape[1]}; "
                              "call reset() when the model changes.")
        if h.shape[0] != x.shape[0]:  # row i may no longer be worker i: restart rather than mix workers up
            return None
        return h

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        h = self._history(x)
        if h is None:
            self.restarts += self.history is not None
            h = x.clone()
        else:
            h = h.to(device=x.device, dtype=x.dtype)
            h += x
        self.history = h
        return combine(x, T.foolsgold_coefficients(h, None, self.kappa))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return T.foolsgold_coefficients(x, self._history(x), self.kappa)

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": "foolsgold", "history": (n, d) tensor or None}``."""
        return {"rule": self.name, "history": None if self.history is None else self.history.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        h = state.get("history")
        self.history = None if h is None else torch.as_tensor(h).clone()

    def reset(self) -> None:
        """Forget the histories."""
        self.history = None

    def _params(self) -> dict[str, Any]:
        return {"kappa": self.kappa, "f": self.f}
