"""The shell every rule shares: validation, requirement checks, state handling."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from .._tensor import Submissions, as_matrix, check_finite
from ..errors import ConfigError
from ..requirements import Requirement, check_f, enforce

__all__ = ["Aggregator", "positive_float", "positive_int"]


def positive_float(value: object, name: str, rule: str) -> float:
    """Validate a strictly positive finite number; raise :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < float("inf")):
        raise ConfigError(f"{rule}: {name} must be a positive finite number; got {value!r}.")
    return float(value)


def positive_int(value: object, name: str, rule: str) -> int:
    """Validate an integer >= 1; raise :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{rule}: {name} must be an integer >= 1; got {value!r}.")
    return value


class Aggregator(abc.ABC):
    """Base class of the robust rules: ``rule(X)`` maps ``(n, d)`` submissions to one ``(d,)`` update.

    Subclasses implement :meth:`_aggregate` (the math, usually one call into
    :mod:`robustagg.functional`) and :attr:`requirement`.

    Args:
        f: declared Byzantine bound (non-negative int), keyword-only.
        strict: when ``False`` a broken requirement only warns (:class:`AssumptionWarning`) so that
            breakdown can be studied; the violations are kept in :attr:`last_violations`.

    Calling:
        ``rule(x)`` with ``x`` a ``(n, d)`` floating tensor (any dtype and device) or a sequence of
        ``(d,)`` tensors; returns a new ``(d,)`` tensor of the same dtype and device (never a view,
        the input is never mutated).

    Raises:
        ShapeError: ``x`` is not ``(n, d)`` floating.
        NonFiniteInputError: a row holds NaN or inf (the message names the rows).
        AssumptionError: the requirement fails for this ``n`` and ``strict`` is true.
        ConfigError: a hyperparameter is out of range (at construction).
    """

    name: ClassVar[str] = ""
    display_name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: Output unchanged when the rows are permuted (up to index tie-breaks).
    permutation_invariant: ClassVar[bool] = True
    #: ``F(X + c) = F(X) + c`` for every constant row ``c``.
    translation_equivariant: ClassVar[bool] = True
    #: The output is one row or a mean of selected rows.
    selects_rows: ClassVar[bool] = False
    #: The output's coordinate j depends only on column j (the rule can run on coordinate shards).
    coordinatewise: ClassVar[bool] = False
    #: Largest tolerated fraction f/n, as text.
    breakdown_point: ClassVar[str] = ""
    #: The kernel's float64 Gram pass already detects NaN/inf rows (on its diagonal) and raises
    #: :class:`~robustagg.errors.NonFiniteInputError` naming them, so the call skips the separate
    #: finiteness pass (about 0.7x the mean's time at d = 1e6).
    gram_checks_finite: ClassVar[bool] = False
    #: The output or the requirement check depends on the declared ``f``, so
    #: :func:`robustagg.get` warns when ``f`` is left at its default 0 (the mean: ``False``).
    f_matters: ClassVar[bool] = True

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        self.f = check_f(f)
        self.strict = bool(strict)
        self.last_violations: list[str] = []

    @property
    @abc.abstractmethod
    def requirement(self) -> Requirement:
        """The rule's honest-participant requirement (see :mod:`robustagg.requirements`)."""

    def violations(self, n: int) -> list[str]:
        """Messages for every way ``n`` rows with this rule's ``f`` break its requirement."""
        return self.requirement.check(n, self.f)

    def check(self, n: int) -> list[str]:
        """Check the requirement for ``n`` workers before any process starts.

        Returns:
            the violations (non-empty only when ``strict=False``).

        Raises:
            AssumptionError: when the requirement fails and ``strict`` is true.
        """
        self.last_violations = enforce([(self.requirement, n, self.f)], strict=self.strict)
        return self.last_violations

    def __call__(self, x: Submissions) -> torch.Tensor:
        x = as_matrix(x)
        self.check(x.shape[0])
        if not self.gram_checks_finite:
            check_finite(x)
        return self._aggregate(x)

    @abc.abstractmethod
    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        """The math on a validated, finite ``(n, d)`` tensor."""

    def weights(self, x: Submissions) -> torch.Tensor:
        """Share of every row in the aggregate that ``rule(x)`` would return now.

        Selection rules: the selection weight (``1/m`` on the m selected rows). Coordinate-wise
        rules: the average over coordinates of the weight the row's value gets (ties by stable
        order). Weighted rules (GM, centered clipping): the final convex coefficient. Used for the
        suppression metrics (``agg/honest_weight/i``, ``agg/byz_accepted``); for stateful rules call
        it *before* ``rule(x)``. No requirement check and no state change.

        Shape: ``(n, d) -> (n,)`` float64 on the input's device.

        Raises:
            ShapeError, NonFiniteInputError: as for a call.
        """
        x = as_matrix(x)
        check_finite(x)
        return self._weights(x)

    @abc.abstractmethod
    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        """Row shares on a validated, finite ``(n, d)`` tensor."""

    # --- state (only stateful rules override) ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule's explicit state (empty for stateless rules), tagged with the rule's name."""
        return {"rule": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ConfigError: the state belongs to another rule.
        """
        if state.get("rule") != self.name:
            raise ConfigError(f"{self.display_name}: cannot load state of rule {state.get('rule')!r}.")

    def reset(self) -> None:
        """Forget any state (no-op for stateless rules)."""

    def _params(self) -> dict[str, Any]:
        return {"f": self.f}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"
