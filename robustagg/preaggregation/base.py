"""The shell of pre-aggregation maps ``(n, d) -> (m, d)``."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from .._tensor import Submissions, as_matrix, check_finite
from ..errors import ConfigError
from ..requirements import Requirement, check_f, enforce

__all__ = ["PreAggregator"]


class PreAggregator(abc.ABC):
    """Base class of pre-aggregation maps, composed with a rule by :class:`~robustagg.Pipeline`.

    Args:
        f: declared Byzantine bound (maps that do not use it ignore it).
        strict: raise (default) or warn when the requirement fails.

    Calling:
        ``pre(x)`` with ``x`` ``(n, d)`` floating returns a new ``(m, d)`` tensor, ``m =
        output_rows(n)``, same dtype and device.

    Raises:
        ShapeError, NonFiniteInputError, AssumptionError: as for :class:`~robustagg.Aggregator`.
    """

    name: ClassVar[str] = ""
    display_name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: ``requirement`` is None for maps that hold for every ``(n, f)``.
    requirement: Requirement | None = None
    #: The map's output depends on the declared ``f`` (NNM, ARC), so :func:`robustagg.get` warns
    #: when ``f`` is left at its default 0; ``False`` where ``f`` is informational.
    f_matters: ClassVar[bool] = True

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        self.f = check_f(f)
        self.strict = bool(strict)

    def output_rows(self, n: int) -> int:
        """Number of rows ``m`` the map outputs for ``n`` input rows (default ``n``)."""
        return n

    def violations(self, n: int) -> list[str]:
        """Requirement violations for ``n`` input rows."""
        return [] if self.requirement is None else self.requirement.check(n, self.f)

    def __call__(self, x: Submissions) -> torch.Tensor:
        x = as_matrix(x)
        if self.requirement is not None:
            enforce([(self.requirement, x.shape[0], self.f)], strict=self.strict)
        check_finite(x)
        return self.apply(x)

    @abc.abstractmethod
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The map on a validated finite ``(n, d)`` tensor (no checks)."""

    @abc.abstractmethod
    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(m, n)`` float64 matrix ``M`` with ``apply(x) == M @ x`` for this input (no state change).

        Used to carry a rule's row shares back to the original rows (``Pipeline.weights``).
        """

    def state_dict(self) -> dict[str, Any]:
        """Explicit state (empty unless the map keeps some), tagged with the map's name."""
        return {"rule": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses another map's state with :class:`ConfigError`."""
        if state.get("rule") != self.name:
            raise ConfigError(f"{self.display_name}: cannot load state of {state.get('rule')!r}.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(f={self.f})"
