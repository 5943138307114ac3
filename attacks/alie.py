"""A Little Is Enough (ALIE): a small per-coordinate shift inside the honest spread."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError

from ._stats import mean64, std64
from .base import Attack, Knowledge, choice, finite_float
from .registry import register

__all__ = ["ALIE", "alie_z"]


def alie_z(n: int, f: int) -> float:
    r"""The paper's z for ``n`` workers of which ``f`` are Byzantine.

    ``s = floor(n/2 + 1) - f`` is the number of honest workers the attackers need on their side
    for a majority; ``z = Phi^{-1}((n - s) / n)`` with ``Phi`` the standard normal CDF
    (``scipy.special.ndtri``, the function ``scipy.stats.norm.ppf`` evaluates for the standard
    normal: the same bits, without importing ``scipy.stats``, about a second of start-up).

    Raises:
        ConfigError: ``s <= 0`` (``f >= floor(n/2) + 1``): the attackers already hold a majority and
            the paper's z is undefined (it would be ``+inf``); pass an explicit ``z``.

    Example:
        >>> round(alie_z(7, 2), 10)  # s = floor(4.5) - 2 = 2, z = Phi^-1(5/7)
        0.5659488219
    """
    s = math.floor(n / 2 + 1) - f
    if s <= 0:
        raise ConfigError(f"ALIE: the paper's z is undefined for n={n}, f={f}: s = floor(n/2 + 1) - f = {s} <= 0 "
                          "(the Byzantine workers already hold a majority). Pass an explicit z, or use fewer "
                          "Byzantine workers.")
    from scipy.special import ndtri  # type: ignore[import-untyped]  # lazy: only runs that use ALIE pay

    return float(ndtri((n - s) / n))


@register("alie")
class ALIE(Attack):
    r"""A Little Is Enough: shift every coordinate by z standard deviations below the mean.

    Definition: ``b[j] = mu[j] - z * sigma[j]`` for every coordinate j, all ``f`` rows equal, where
    ``mu`` and ``sigma`` are the coordinate-wise mean and standard deviation (**ddof = 1**; a single
    row gives ``sigma = 0``) of the statistics source. Default ``z`` is the paper's
    ``z = Phi^{-1}((n - s)/n)``, ``s = floor(n/2 + 1) - f``, with ``n = h + num_byzantine`` and
    ``f = num_byzantine`` (see :func:`alie_z`).

    Knowledge: ``source="honest"`` (default): the honest rows (omniscient, the common benchmark
    setting); ``source="own"``: the Byzantine workers' own honest gradients (``own=``), the paper's
    original knowledge model. The instance's :attr:`knowledge` follows ``source``.

    Args:
        z: ``None`` (default) for the paper's z, or an explicit finite number.
        source: ``"honest"`` (default) or ``"own"``.

    Shape: ``honest (h, d) -> (f, d)``; statistics in float64.

    Raises:
        ConfigError: the paper's ``s <= 0`` while ``z`` is None (message says so); ``own`` missing
            with ``source="own"``; ``z`` not finite or ``source`` unknown.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Public code differs in the standard deviation (numpy's default ddof = 0), in the source of
        the statistics (all n workers' honest gradients, or only the Byzantine ones'), in the sign
        (``mu + z sigma``, symmetric for the analysis) and sometimes fixes z (e.g. 1.0 or 1.5)
        instead of the paper's formula.

    Example:
        >>> import torch, attacks
        >>> honest = torch.tensor([[1.0, 0.0], [3.0, 4.0], [2.0, 2.0]])
        >>> attacks.ALIE(z=1.0)(honest, 2)  # mu = (2, 2), sigma = (1, 2)
        tensor([[1., 0.],
                [1., 0.]])

    References:
        Baruch, Baruch, Goldberg, "A little is enough: circumventing defenses for distributed
        learning", NeurIPS 2019.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.HONEST
    paper = "Baruch, Baruch, Goldberg, NeurIPS 2019"

    def __init__(self, *, z: Optional[float] = None, source: str = "honest") -> None:
        self.z = None if z is None else finite_float(z, "z", "ALIE")
        self.source = choice(source, "source", "ALIE", ("honest", "own"))
        self.knowledge = Knowledge.OWN if self.source == "own" else Knowledge.HONEST
        #: The z used by the last call.
        self.last_z: Optional[float] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        z = alie_z(honest.shape[0] + f, f) if self.z is None else self.z
        self.last_z = z
        src = own if self.source == "own" else honest
        assert src is not None
        return mean64(src) - z * std64(src)

    def _params(self) -> dict[str, Any]:
        return {"z": self.z, "source": self.source}
