"""Honest-participant requirements of robust rules.

A :class:`Requirement` is the printable inequality a rule needs between the number of submitted
rows ``n`` and the declared Byzantine bound ``f`` (e.g. Krum's ``n >= 2f + 3``), the paper it comes
from, and the robustness coefficient bound ``kappa(n, f)`` where the literature gives one
(Allouah et al., "Fixing by Mixing", AISTATS 2023, Table 1 / Prop. 1-6).

All messages are generated from one template so every rule refuses in the same words::

    Krum requires n >= 2f + 3 (Blanchard et al., NeurIPS 2017); got n=6, f=2. Lower f, add
    workers, or pass strict=False to study breakdown.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .errors import AssumptionError, AssumptionWarning, ConfigError

__all__ = ["Requirement", "linear", "enforce", "lower_bound_kappa", "MESSAGE_FIX"]

MESSAGE_FIX = "Lower f, add workers, or pass strict=False to study breakdown."


@dataclass(frozen=True)
class Requirement:
    """An inequality between ``n`` (rows the rule sees) and ``f`` (declared Byzantine bound).

    Args:
        rule: display name used in messages, e.g. ``"Krum"``.
        inequality: the printable form, e.g. ``"n >= 2f + 3"``.
        holds: predicate ``(n, f) -> bool``; ``n`` and ``f`` are non-negative ints.
        paper: short citation, e.g. ``"Blanchard et al., NeurIPS 2017"``.
        kappa: optional ``(n, f) -> float`` upper bound on the (f, kappa)-robustness coefficient.
        kappa_formula: printable form of ``kappa``.
        breakdown: printable breakdown point (largest tolerated fraction f/n).
        advisory: a violation only warns, even under ``strict=True`` (the mean as a baseline).

    Raises:
        ConfigError: never at construction; :meth:`check` raises nothing, :func:`enforce` raises
            :class:`AssumptionError`.
    """

    rule: str
    inequality: str
    holds: Callable[[int, int], bool] = field(compare=False, repr=False)
    paper: str = ""
    kappa: Optional[Callable[[int, int], float]] = field(default=None, compare=False, repr=False)
    kappa_formula: Optional[str] = None
    breakdown: str = ""
    advisory: bool = False

    def check(self, n: int, f: int) -> list[str]:
        """Return the list of violation messages for ``(n, f)`` (empty when the requirement holds)."""
        if self.holds(int(n), int(f)):
            return []
        cite = f" ({self.paper})" if self.paper else ""
        return [f"{self.rule} requires {self.inequality}{cite}; got n={n}, f={f}."]

    def kappa_bound(self, n: int, f: int) -> float:
        """The literature's kappa upper bound at ``(n, f)``, or ``nan`` when none is known."""
        if self.kappa is None or not self.holds(n, f):
            return math.nan
        return float(self.kappa(n, f))

    def __str__(self) -> str:
        return f"{self.rule}: {self.inequality}" + (f" ({self.paper})" if self.paper else "")


def linear(rule: str, a: int, b: int, paper: str, **kw) -> Requirement:
    """Requirement ``n >= a*f + b`` (e.g. ``linear("Krum", 2, 3, ...)`` is ``n >= 2f + 3``)."""
    inequality = f"n >= {a}f + {b}" if a != 1 else f"n >= f + {b}"
    return Requirement(rule, inequality, lambda n, f: n >= a * f + b and n >= 1, paper, **kw)


def lower_bound_kappa(n: int, f: int) -> float:
    """The best possible robustness coefficient ``f / (n - 2f)`` (Allouah et al., AISTATS 2023).

    Returns ``inf`` when ``n <= 2f`` (no rule is robust there).
    """
    return f / (n - 2 * f) if n > 2 * f else math.inf


def enforce(requirements: Sequence[tuple[Requirement, int, int]], *, strict: bool) -> list[str]:
    """Check each ``(requirement, n, f)``; raise or warn on violations.

    Returns:
        the list of violation messages (empty when everything holds).

    Raises:
        AssumptionError: when ``strict`` and any requirement fails; all violations are listed in
            one message, followed by the fix.
    """
    hard = [msg for req, n, f in requirements if not req.advisory for msg in req.check(n, f)]
    soft = [msg for req, n, f in requirements if req.advisory for msg in req.check(n, f)]
    if hard and strict:
        raise AssumptionError(" ".join(hard) + " " + MESSAGE_FIX)
    if hard or soft:
        text = " ".join(hard + soft) + (" " + MESSAGE_FIX if hard else " (advisory: the rule runs as the baseline.)")
        warnings.warn(text, AssumptionWarning, stacklevel=3)
    return hard + soft


def check_f(f: object, name: str = "f") -> int:
    """Validate a declared Byzantine bound: a non-negative int.

    Raises:
        ConfigError: naming the argument when ``f`` is not a non-negative integer.
    """
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ConfigError(f"{name} must be a non-negative integer (the declared Byzantine bound); got {f!r}.")
    return f
