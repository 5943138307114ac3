"""Name -> class registry of the attack zoo.

``attacks.get("alie", z=1.0)`` builds an attack by its snake_case name; ``attacks.available()``
lists the names. Registering a name twice is refused, and so is any parameter the class does not
take (never silently dropped).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, TypeVar

from robustagg.errors import ConfigError

from .base import Attack

__all__ = ["register", "get", "available", "lookup"]

_REGISTRY: dict[str, type[Attack]] = {}
T = TypeVar("T", bound=type[Attack])


def register(name: str) -> Callable[[T], T]:
    """Class decorator adding an :class:`~attacks.Attack` subclass under ``name``; sets ``cls.name``.

    Raises:
        ConfigError: ``name`` is already registered (to any class).
    """

    def deco(cls: T) -> T:
        if name in _REGISTRY:
            raise ConfigError(f"attacks registry already has {name!r} ({_REGISTRY[name].__qualname__}); "
                              "pick another name.")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available() -> list[str]:
    """Sorted names of every registered attack."""
    return sorted(_REGISTRY)


def lookup(name: str) -> type[Attack]:
    """The attack class registered under ``name``.

    Raises:
        ConfigError: unknown name; the message names the nearest ones and lists all.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        near = difflib.get_close_matches(str(name), available(), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ConfigError(f"unknown attack {name!r}{hint}; available: {', '.join(available())}.") from None


def get(name: str, **params: Any) -> Attack:
    """Build the attack registered under ``name`` with keyword ``params``.

    Example:
        >>> import attacks
        >>> attacks.get("ipm", epsilon=0.5)
        IPM(epsilon=0.5)

    Raises:
        ConfigError: unknown name, a parameter the class does not take (the message lists the ones
            it takes), or a parameter value out of range.
    """
    cls = lookup(name)
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in sig.parameters if p != "self"]
    try:
        sig.bind(None, **params)
    except TypeError:
        unknown = sorted(set(params) - set(accepted))
        raise ConfigError(f"attack {name!r} ({cls.__name__}) does not take {', '.join(map(repr, unknown)) or params}; "
                          f"its parameters: {', '.join(accepted) or '(none)'}.") from None
    return cls(**params)
