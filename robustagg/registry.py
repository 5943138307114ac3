"""Name -> class registry of every rule and pre-aggregator.

``robustagg.get("krum", f=2)`` builds a rule by its snake_case name; ``available()`` lists the
names. Registering the same name twice is refused. ``get`` without ``f`` builds the rule for
``f = 0`` Byzantine workers and warns (:class:`~robustagg.errors.AssumptionWarning`) for every
rule or map whose output or requirement depends on ``f`` (``f_matters``; not the mean).
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from .errors import AssumptionWarning, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .aggregators.base import Aggregator

__all__ = ["register", "get", "available", "lookup", "build_pipeline"]

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator adding ``cls`` under ``name``; sets ``cls.name``.

    Raises:
        ValueError: when ``name`` is already registered.
    """

    def deco(cls: T) -> T:
        if name in _REGISTRY and not _same_definition(_REGISTRY[name], cls):
            raise ValueError(f"robustagg registry already has {name!r} ({_REGISTRY[name].__qualname__}).")
        _REGISTRY[name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return deco


def _same_definition(a: type, b: type) -> bool:
    # The same class statement executed twice (a module imported under two names, as pytest's
    # doctest collection can do) re-registers itself; a different class under a taken name is refused.
    try:
        return a.__qualname__ == b.__qualname__ and inspect.getfile(a) == inspect.getfile(b)
    except TypeError:
        return False


def available() -> list[str]:
    """Sorted names of every registered rule and pre-aggregator."""
    return sorted(_REGISTRY)


def lookup(name: str) -> type:
    """The class registered under ``name``.

    Raises:
        ConfigError: unknown name; the message names the nearest ones and lists all.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        near = difflib.get_close_matches(str(name), available(), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ConfigError(f"unknown aggregator {name!r}{hint}; available: {', '.join(available())}.") from None


def get(name: str, **params: Any) -> Any:
    """Build the rule or pre-aggregator registered under ``name`` with keyword ``params``.

    A name with ``>`` (``"nnm>trimmed_mean"``) builds a :class:`~robustagg.Pipeline`; see
    :func:`build_pipeline` for how parameters are routed.

    Warns:
        AssumptionWarning: ``f`` not given for a rule or map whose output or requirement depends
            on it: the default ``f = 0`` tolerates no Byzantine worker (the trimmed mean trims
            nothing). Python shows it once per calling line; pass ``f`` (``f=0`` too) to silence it.

    Raises:
        ConfigError: unknown name, a parameter the class does not take (never silently dropped),
            or an unknown name inside a ``>`` spec.

    Example:
        >>> import robustagg as ra
        >>> ra.get("trimmed_mean", f=2)
        CoordinateWiseTrimmedMean(f=2)
    """
    if "f" not in params:
        _warn_default_f(name)
    if ">" in name:
        return build_pipeline(name, **params)
    cls = lookup(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}. See help(robustagg.{cls.__name__}) for its parameters.") from None


def _warn_default_f(spec: str) -> None:
    stages = [s.strip() for s in spec.split(">")]
    if not any(getattr(_REGISTRY.get(s), "f_matters", False) for s in stages):
        return  # unknown names are refused by the caller; the mean and informational maps need no f
    warnings.warn(f"robustagg.get({spec!r}) without f builds it for f=0 Byzantine workers: it tolerates none "
                  f"(its requirement is checked for f=0). Pass the bound you assume, e.g. "
                  f"robustagg.get({spec!r}, f=1).", AssumptionWarning, stacklevel=3)


def _build(name: str, params: dict[str, Any], f: int | None, strict: bool | None) -> Any:
    cls = lookup(name)
    sig = inspect.signature(cls)
    kw = dict(params)
    if f is not None and "f" in sig.parameters:
        kw["f"] = f
    if strict is not None and "strict" in sig.parameters:
        kw["strict"] = strict
    try:
        return cls(**kw)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}. See help(robustagg.{cls.__name__}) for its parameters.") from None


def build_pipeline(spec: str, *, f: int | None = None, strict: bool | None = None,
                   pre_params: Sequence[dict[str, Any]] | None = None, **rule_params: Any) -> Aggregator:
    """Build ``"nnm>trimmed_mean"``-style specs: maps separated by ``>``, the rule last.

    ``f`` and ``strict`` go to every stage that takes them; ``pre_params[i]`` to the i-th map;
    other keywords to the rule. A spec without ``>`` builds the rule alone.

    Raises:
        ConfigError: unknown names, a map in the last position, a rule before it, or bad params.
    """
    names = [s.strip() for s in spec.split(">")]
    pre_params = list(pre_params or [{}] * (len(names) - 1))
    if len(pre_params) != len(names) - 1:
        raise ConfigError(f"{spec}: pre_params needs one dict per pre-aggregation map ({len(names) - 1}).")
    from .aggregators.base import Aggregator
    from .preaggregation.base import PreAggregator
    from .preaggregation.pipeline import Pipeline

    pre = [_build(nm, p, f, strict) for nm, p in zip(names[:-1], pre_params)]
    rule = _build(names[-1], rule_params, f, strict)
    if any(not isinstance(p, PreAggregator) for p in pre) or not isinstance(rule, Aggregator):
        raise ConfigError(f"{spec}: expected pre-aggregation maps then one rule, e.g. 'nnm>trimmed_mean'.")
    return Pipeline(pre=pre, rule=rule) if pre else rule
