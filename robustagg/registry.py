"""Name -> class registry of every rule and pre-aggregator.

``robustagg.get("krum", f=2)`` builds a rule by its snake_case name; ``available()`` lists the
names. Registering the same name twice is refused.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .errors import ConfigError

__all__ = ["register", "get", "available", "lookup"]

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
    import inspect

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
        ConfigError: unknown name; the message lists the available ones.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown aggregator {name!r}; available: {', '.join(available())}.") from None


def get(name: str, **params: Any) -> Any:
    """Build the rule or pre-aggregator registered under ``name`` with keyword ``params``.

    A name with ``>`` (``"nnm>trimmed_mean"``) builds a :class:`~robustagg.Pipeline`; see
    :func:`robustagg.preaggregation.build_pipeline` for how parameters are routed.

    Raises:
        ConfigError: unknown name, or a parameter the class does not take (never silently dropped).
    """
    if ">" in name:
        from .preaggregation.pipeline import build_pipeline

        return build_pipeline(name, **params)
    cls = lookup(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}. See help(robustagg.{cls.__name__}) for its parameters.") from None
