"""Closed-form gradient attacks: SignFlip, BitFlip, IPM, Gaussian, Zero, Constant, LargeNorm."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError

from ._stats import mean64, randn64
from .base import Attack, Knowledge, finite_float, positive_float
from .registry import register

__all__ = ["SignFlip", "BitFlip", "IPM", "Gaussian", "Zero", "Constant", "LargeNorm"]

_Rule = Optional[Callable[[torch.Tensor], torch.Tensor]]


@register("sign_flip")
class SignFlip(Attack):
    r"""Sign flipping: every Byzantine row is the negated honest mean.

    Definition: ``b = -x̄_H`` with ``x̄_H = (1/h) sum_{i in H} x_i``; all ``f`` rows are equal.

    Knowledge: ``honest`` (omniscient). No parameters.

    Shape: ``honest (h, d) -> (f, d)``, dtype and device of ``honest``; the mean is accumulated in
    float64.

    Raises:
        ShapeError, NonFiniteInputError, ConfigError: see :class:`~attacks.Attack`.

    Note:
        Public code also calls "sign flipping" the negation of each Byzantine worker's *own*
        gradient; that variant is :class:`BitFlip` here. Some code scales the negated mean
        (``-c * x̄_H``); with a scale it is :class:`IPM` with ``epsilon = c``.

    Example:
        >>> import torch, attacks
        >>> attacks.SignFlip()(torch.tensor([[1.0, 0.0], [3.0, -4.0]]), 2)
        tensor([[-2.,  2.],
                [-2.,  2.]])

    References:
        Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing by mixing", AISTATS 2023
        (the sign-flipping attack as ``-x̄_H``).
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.HONEST
    paper = "Allouah et al., AISTATS 2023"

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        return -mean64(honest)


@register("bit_flip")
class BitFlip(Attack):
    r"""Bit flipping (reversed gradient): each Byzantine worker negates its own honest gradient.

    Definition: ``b_k = -scale * g_k`` for the k-th Byzantine worker's own honestly computed
    gradient ``g_k`` (``own[k]``).

    Knowledge: ``own`` (no knowledge of the honest rows).

    Args:
        scale: positive finite multiplier, default ``1.0`` (the plain reversed gradient).

    Shape: ``own (f, d) -> (f, d)``.

    Raises:
        ConfigError: ``own`` missing, or ``scale`` not a positive finite number.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Named after flipping the sign bit of every coordinate. Public code sometimes applies a scale
        (e.g. ``-4 g``, "reversed gradient" with a large factor); that is ``scale=4``.

    Example:
        >>> import torch, attacks
        >>> honest = torch.zeros(3, 2)
        >>> attacks.BitFlip(scale=2.0)(honest, 1, own=torch.tensor([[1.0, -0.5]]))
        tensor([[-2.,  1.]])

    References:
        Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", arXiv:1802.10116, 2018 (bit-flip
        attack); used as "BF" by Karimireddy, He, Jaggi, ICML 2021.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.OWN
    paper = "Xie, Koyejo, Gupta, arXiv 2018"

    def __init__(self, *, scale: float = 1.0) -> None:
        self.scale = positive_float(scale, "scale", "BitFlip")

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert own is not None
        return own.to(torch.float64) * (-self.scale)

    def _params(self) -> dict[str, Any]:
        return {"scale": self.scale}


@register("ipm")
class IPM(Attack):
    r"""Inner-product manipulation: a small negative multiple of the honest mean.

    Definition: ``b = -epsilon * x̄_H``; all ``f`` rows equal. Against the mean of all ``n`` rows
    the output is ``((n - f) - f * epsilon) x̄_H / n``, whose inner product with ``x̄_H`` is
    negative exactly when ``epsilon > (n - f) / f``; robust rules that keep rows near the honest
    cloud can be turned with a small ``epsilon``.

    Knowledge: ``honest`` (omniscient).

    Args:
        epsilon: positive finite, default ``0.1``.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: ``epsilon`` not a positive finite number.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The paper uses a small epsilon (e.g. 0.1) against median-type rules and larger values
        against others; public code sometimes averages over all n workers' honest gradients
        (including the Byzantine workers' own) instead of the honest ones.

    Example:
        >>> import torch, attacks
        >>> attacks.IPM(epsilon=0.5)(torch.tensor([[2.0, -4.0], [4.0, 0.0]]), 1)
        tensor([[-1.5000,  1.0000]])

    References:
        Xie, Koyejo, Gupta, "Fall of empires: breaking Byzantine-tolerant SGD by inner product
        manipulation", UAI 2019.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.HONEST
    paper = "Xie, Koyejo, Gupta, UAI 2019"

    def __init__(self, *, epsilon: float = 0.1) -> None:
        self.epsilon = positive_float(epsilon, "epsilon", "IPM")

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        return -self.epsilon * mean64(honest)

    def _params(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon}


@register("gaussian")
class Gaussian(Attack):
    r"""Gaussian noise: every coordinate of every Byzantine row drawn from ``N(mu, sigma^2)``.

    Definition: ``b_k[j] = mu + sigma * e_kj`` with ``e_kj ~ N(0, 1)`` i.i.d. (float64 samples from
    ``generator``, then cast).

    Knowledge: ``none``.

    Args:
        mu: finite mean, default ``0.0``.
        sigma: finite standard deviation ``>= 0``, default ``200.0`` (a scale far above typical
            gradient coordinates, as in the Byzantine-ML benchmarks).

    Shape: ``(h, d) -> (f, d)``; ``honest`` only gives ``d``, dtype and device.

    Raises:
        ConfigError: ``mu`` or ``sigma`` out of range.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Deterministic for a seeded ``generator`` (samples are drawn on its device); ``None`` uses
        the global torch RNG. Public code varies ``sigma`` widely (1 to 200); some adds the noise
        to the honest mean instead of to ``mu``.

    Example:
        >>> import torch, attacks
        >>> g = torch.Generator().manual_seed(0)
        >>> attacks.Gaussian(mu=1.0, sigma=0.0)(torch.zeros(2, 3), 1, generator=g)
        tensor([[1., 1., 1.]])

    References:
        Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017 (Gaussian Byzantine vectors in
        their experiments); Xie, Koyejo, Gupta, arXiv 2018.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.NONE
    paper = "Blanchard et al., NeurIPS 2017"

    def __init__(self, *, mu: float = 0.0, sigma: float = 200.0) -> None:
        self.mu = finite_float(mu, "mu", "Gaussian")
        self.sigma = finite_float(sigma, "sigma", "Gaussian")
        if self.sigma < 0:
            raise ConfigError(f"Gaussian: sigma must be >= 0; got {sigma!r}.")

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        return self.mu + self.sigma * randn64((f, honest.shape[1]), generator, honest.device)

    def _params(self) -> dict[str, Any]:
        return {"mu": self.mu, "sigma": self.sigma}


@register("zero")
class Zero(Attack):
    r"""Zero gradient: every Byzantine row is ``0``.

    Knowledge: ``none``. No parameters.

    Shape: ``(h, d) -> (f, d)``; ``honest`` only gives ``d``, dtype and device.

    Note:
        Equivalent to ``Constant(c=0)``; it pulls the mean towards zero and models workers that
        stall the training without being conspicuous.

    Example:
        >>> import torch, attacks
        >>> attacks.Zero()(torch.ones(2, 3, dtype=torch.float64), 1)
        tensor([[0., 0., 0.]], dtype=torch.float64)

    References:
        A standard baseline of the Byzantine-ML benchmarks (e.g. Allouah et al., AISTATS 2023).
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.NONE
    paper = "baseline"

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        return torch.zeros(honest.shape[1], dtype=torch.float64, device=honest.device)


@register("constant")
class Constant(Attack):
    r"""Constant: every coordinate of every Byzantine row is ``c``.

    Definition: ``b = c * 1`` (the all-``c`` vector).

    Knowledge: ``none``.

    Args:
        c: finite constant, default ``1.0``. Values the dtype cannot hold saturate to its largest
            finite value.

    Shape: ``(h, d) -> (f, d)``.

    Raises:
        ConfigError: ``c`` not finite.

    Example:
        >>> import torch, attacks
        >>> attacks.Constant(c=-3.0)(torch.zeros(4, 2), 2)
        tensor([[-3., -3.],
                [-3., -3.]])

    References:
        A standard baseline of the Byzantine-ML benchmarks.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.NONE
    paper = "baseline"

    def __init__(self, *, c: float = 1.0) -> None:
        self.c = finite_float(c, "c", type(self).__name__)

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        return torch.full((honest.shape[1],), self.c, dtype=torch.float64, device=honest.device)

    def _params(self) -> dict[str, Any]:
        return {"c": self.c}


@register("large_norm")
class LargeNorm(Constant):
    r"""Large norm: the constant vector ``c * 1`` with a large default ``c = 1e6``.

    Definition: ``b = c * 1`` as :class:`Constant`; only the default differs. The row has norm
    ``|c| sqrt(d)``; it breaks the mean and is what every robust rule must survive.

    Knowledge: ``none``.

    Args:
        c: finite constant, default ``1e6``; saturates to the dtype's largest finite value
            (``float16``: 65504).

    Shape: ``(h, d) -> (f, d)``; ``honest`` only gives ``d``, dtype and device.

    Raises:
        ConfigError: ``c`` not finite.

    Example:
        >>> import torch, attacks
        >>> attacks.LargeNorm()(torch.zeros(3, 2), 1)
        tensor([[1000000., 1000000.]])

    References:
        A standard baseline of the Byzantine-ML benchmarks.
    """

    def __init__(self, *, c: float = 1e6) -> None:
        super().__init__(c=c)
