"""Rules computed by iteration in the span of the rows: GeometricMedian, CenteredClipping."""

from __future__ import annotations

from typing import Any

import torch

from .. import functional as F
from ..functional.weiszfeld import centered_clipping_coefficients, geometric_median_coefficients
from ..errors import ConfigError
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator, positive_float, positive_int

__all__ = ["GeometricMedian", "CenteredClipping"]


@register("geometric_median")
class GeometricMedian(Aggregator):
    r"""Geometric median (GM) by smoothed Weiszfeld iterations.

    Definition: ``GM(X) = argmin_z sum_i ||z - x_i||``, approximated by
    ``z <- sum_i beta_i x_i / sum_i beta_i`` with ``beta_i = 1 / max(nu, ||z - x_i||)``, starting at
    ``init`` (the mean or zero), for at most ``max_iter`` updates, stopping early when no distance
    ``||z - x_i||`` changes by more than ``tol`` relative to ``max(nu, its previous value)``.

    Requirement: ``n >= 2f + 1``; the exact GM is (f, kappa)-robust with
    ``kappa <= 4 (1 + f/(n-2f))^2`` (Allouah et al., AISTATS 2023). Breakdown point 1/2.

    Args:
        nu: smoothing floor on distances (> 0), gradient units. Default 1e-6.
        max_iter: maximum Weiszfeld updates (>= 1). Default 100.
        tol: largest relative change of a distance ``||z - x_i||`` at which to stop (>= 0; 0
            stops only when no distance changes). Default 1e-10 (see Note).
        init: ``"mean"`` (default) or ``"zero"``.
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: a hyperparameter out of range, or an unknown ``init``.

    Note:
        The design notes stop on a relative change of the objective ``sum_i ||z - x_i||`` below
        1e-6. That change is quadratic in the error of ``z`` (on the reference case, 7 rows in 2-D,
        it stops with an error of 1e-3, and even at 1e-12 with 5e-6), and one huge row's distance
        dominates the objective, so that next to a 1e20 row it stops at ~100 instead of ~0.5. Here
        every distance must settle: with the default ``tol = 1e-10`` the reference case is exact
        to 2e-10. Weiszfeld converges slowly when the median sits at or very near an input row;
        100 iterations can then leave a relative objective gap up to about 1e-4 and a point error
        up to about 1e-2 of the data's spread (seen on small integer inputs); raise ``max_iter``
        when that matters.
        RFA (Pillutla, Kakade, Harchaoui, IEEE TSP 2022) runs a few iterations with ``nu = 1e-5``:
        ``GeometricMedian(nu=1e-5, max_iter=3, tol=0)``. Other public code starts at zero with
        ``nu = 0.1`` and 3-8 iterations: ``GeometricMedian(nu=0.1, max_iter=8, tol=0, init="zero")``.
        Iterations run on a float64 Gram matrix of the rows (O(n^2) each); the output is formed once.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [30.0, 30.0]], dtype=torch.float64)
        >>> ra.GeometricMedian(f=1)(x).round(decimals=4)  # at (1, 1) the four unit pulls cancel
        tensor([1., 1.], dtype=torch.float64)
    """

    display_name = "Geometric median"
    gram_checks_finite = True
    paper = "Pillutla, Kakade, Harchaoui, IEEE TSP 2022"
    breakdown_point = "1/2"

    def __init__(self, *, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-10, init: str = "mean",
                 f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.nu = positive_float(nu, "nu", "Geometric median")
        self.max_iter = positive_int(max_iter, "max_iter", "Geometric median")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
            raise ConfigError(f"Geometric median: tol must be a number in [0, 1); got {tol!r}.")
        self.tol = float(tol)
        if init not in ("mean", "zero"):
            raise ConfigError(f"Geometric median: init must be 'mean' or 'zero'; got {init!r}.")
        self.init = init
        self.translation_equivariant = init == "mean"  # type: ignore[misc]

    @property
    def requirement(self) -> Requirement:
        return linear("Geometric median", 2, 1, self.paper, kappa=lambda n, f: 4 * (1 + f / (n - 2 * f)) ** 2,
                      kappa_formula="4(1 + f/(n-2f))^2", breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.geometric_median(x, self.nu, self.max_iter, self.tol, self.init)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = geometric_median_coefficients(x, self.nu, self.max_iter, self.tol, self.init)
        return a[:x.shape[0]]

    def _params(self) -> dict[str, Any]:
        return {"nu": self.nu, "max_iter": self.max_iter, "tol": self.tol, "init": self.init, "f": self.f}


@register("centered_clipping")
class CenteredClipping(Aggregator):
    r"""Centered clipping (CClip), a stateful rule.

    Definition: ``v <- v + (1/n) sum_i clip_tau(x_i - v)`` repeated ``L = iterations`` times, with
    ``clip_tau(u) = u * min(1, tau/||u||)`` (0 stays 0). ``v`` starts at the previous call's
    output (zero before the first call): that centre is explicit state (:meth:`state_dict`).

    Requirement: a small Byzantine fraction. Karimireddy, He, Jaggi (ICML 2021, Thm. III) analyse
    ``f/n <= 0.1`` with worker momentum and a tau tuned to the honest variance; this class refuses
    ``f >= n/2`` (``n >= 2f + 1``), where no rule is robust.

    Args:
        tau: clipping radius (> 0), gradient-norm units. Default 10.
        iterations: L >= 1. Default 3.
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``. The centre is kept on the input's device and dtype.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``tau`` or ``iterations`` out of range; a centre of the wrong length.

    Note:
        Not translation equivariant: the centre does not move with the inputs.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [10.0, 10.0]], dtype=torch.float64)
        >>> cc = ra.CenteredClipping(tau=1.0, iterations=1)
        >>> cc(x).round(decimals=4)  # (e1 + e2 + (10,10)/||(10,10)||) / 3 from v = 0
        tensor([0.5690, 0.5690], dtype=torch.float64)
        >>> cc.state_dict()["center"].round(decimals=4)
        tensor([0.5690, 0.5690], dtype=torch.float64)
    """

    display_name = "Centered clipping"
    gram_checks_finite = True
    paper = "Karimireddy, He, Jaggi, ICML 2021"
    translation_equivariant = False
    breakdown_point = "analysed for f/n <= 0.1"

    def __init__(self, *, tau: float = 10.0, iterations: int = 3, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.tau = positive_float(tau, "tau", "Centered clipping")
        self.iterations = positive_int(iterations, "iterations", "Centered clipping")
        self.center: torch.Tensor | None = None

    @property
    def requirement(self) -> Requirement:
        return linear("Centered clipping", 2, 1, self.paper, breakdown="analysed for f/n <= 0.1")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        out = F.centered_clipping(x, self.tau, self.iterations, self._start(x))
        self.center = out.clone()
        return out

    def _start(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[1]
        if self.center is not None and self.center.numel() != d:
            raise ConfigError(f"Centered clipping: stored centre has {self.center.numel()} entries but "
                              f"the submissions have d={d}; call reset() when the model changes.")
        return torch.zeros(d, dtype=x.dtype, device=x.device) if self.center is None else self.center

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = centered_clipping_coefficients(x, self.tau, self.iterations, self._start(x))
        return a[:x.shape[0]]

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": "centered_clipping", "center": (d,) tensor or None}``."""
        return {"rule": self.name, "center": None if self.center is None else self.center.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        c = state.get("center")
        self.center = None if c is None else torch.as_tensor(c).clone()

    def reset(self) -> None:
        """Forget the centre (the next call starts from zero)."""
        self.center = None

    def _params(self) -> dict[str, Any]:
        return {"tau": self.tau, "iterations": self.iterations, "f": self.f}
