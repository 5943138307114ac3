"""Declared ranges of numeric settings: one :class:`Limit` per key, next to the key's declaration.

A setting's type, range and meaning are declared once, in the field of the dataclass that defines
it (``dataclasses.field(default=1, metadata=limit(1, 256, "torch threads per process"))``), and
:func:`limit_problems` derives the check and its message from that declaration. The library's
:class:`~robustagg.launch.RunSettings` declares its own keys this way, so a :class:`~robustagg.launch.Job`
built by hand is refused on exactly the values the app refuses (the app calls the same check); the
app's schema (``experiments/config.py``) declares its own keys (``data.max_train_samples``) the
same way. Every message comes from one template:

    ``<key> must be <an integer | a finite number> in <range> (<meaning>); got <value>. Use e.g. <key>=<example>.``

Example:
    >>> from dataclasses import dataclass, field
    >>> @dataclass
    ... class S:
    ...     threads: int = field(default=1, metadata=limit(1, 256, "torch threads per process", integer=True))
    ...     timeout_s: float = field(default=60.0, metadata=limit(1.0, 86400.0, "seconds a collective waits"))
    >>> limit_problems(S, {"threads": 1000000, "timeout_s": 1e-9})
    ['threads must be an integer in [1, 256] (torch threads per process); got 1000000. Use e.g. threads=1.', 'timeout_s must be a finite number in [1, 86400] (seconds a collective waits); got 1e-09. Use e.g. timeout_s=60.']
    >>> limit_problems(S, {"threads": 4})
    []
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["Limit", "limit", "limit_of", "limit_problems"]

#: The metadata key a :class:`Limit` is stored under in a dataclass field.
KEY = "limit"


def _num(v: float) -> str:
    """``1`` for 1.0, ``0.5`` for 0.5, ``inf`` for infinity: a bound as a reader types it."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


@dataclass(frozen=True)
class Limit:
    """The values one numeric setting may take.

    Attributes:
        low, high: the bounds (``None``: unbounded on that side). low_open, high_open: the bound
            itself is excluded (``(0, 1)`` rather than ``[0, 1]``).
        meaning: what the setting is, in a few words (it goes into the message).
        integer: only whole numbers (``True`` and ``False`` are refused: they are not counts).
        optional: ``None`` (``null``) is allowed and means what the key's docstring says.
        example: the value the message suggests (default: the field's default).
    """

    low: Optional[float] = None
    high: Optional[float] = None
    meaning: str = ""
    integer: bool = False
    optional: bool = False
    low_open: bool = False
    high_open: bool = False
    example: Any = None

    def span(self) -> str:
        """The range in interval notation (``[1, 256]``, ``(0, inf)``, ``[0, 1)``)."""
        lo = "-inf" if self.low is None else _num(self.low)
        hi = "inf" if self.high is None else _num(self.high)
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def holds(self, value: Any) -> bool:
        """True when ``value`` is allowed."""
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not (isinstance(value, int) or (math.isfinite(value) and float(value).is_integer())):
            return False
        v = float(value)
        if math.isnan(v) or (not self.integer and not math.isfinite(v)):
            return False
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        return not (self.high is not None and (v > self.high or (self.high_open and v == self.high)))

    def problem(self, key: str, value: Any, *, default: Any = None) -> str:
        """The one-line message for ``key=value``, or ``""`` when it is allowed.

        Args:
            key: the name the user typed (``trainer.threads``).
            value: the value. default: the example used when :attr:`example` is unset.
        """
        if self.holds(value):
            return ""
        what = "an integer" if self.integer else "a finite number"
        null = " or null" if self.optional else ""
        meaning = f" ({self.meaning})" if self.meaning else ""
        example = self.example if self.example is not None else default
        hint = f" Use e.g. {key}={_num(example) if isinstance(example, (int, float)) else example}." if (
            example is not None and self.holds(example)) else ""
        return f"{key} must be {what} in {self.span()}{null}{meaning}; got {value!r}.{hint}"


def limit(low: Optional[float] = None, high: Optional[float] = None, meaning: str = "", **options: Any
          ) -> dict[str, Limit]:
    """Field metadata declaring a :class:`Limit` (``field(default=..., metadata=limit(...))``)."""
    return {KEY: Limit(low, high, meaning, **options)}


def limit_of(schema: type, name: str) -> Optional[Limit]:
    """The :class:`Limit` declared on field ``name`` of the dataclass ``schema`` (``None``: none declared),
    suggesting the field's default as the example when the declaration names none."""
    for f in dataclasses.fields(schema):
        if f.name == name:
            got = f.metadata.get(KEY)
            if not isinstance(got, Limit):
                return None
            if got.example is None and f.default is not dataclasses.MISSING:
                got = dataclasses.replace(got, example=f.default)  # the message suggests the default
            return got
    return None


def limit_problems(schema: type, values: Any, *, key: Callable[[str], str] = str, prefix: str = "") -> list[str]:
    """Every declared limit of the dataclass ``schema`` that ``values`` breaks, as one-line messages.

    Nested dataclass fields are checked recursively (their keys joined with ``.``).

    Args:
        schema: a dataclass type whose fields may carry :func:`limit` metadata.
        values: an instance of it, or a mapping with (some of) its field names; missing keys are skipped.
        key: turns a field path (``threads``, ``checkpoint.every``) into the key a user types.
        prefix: prepended to nested paths (used by the recursion).

    Returns:
        the messages, in field order (``[]``: every value is in range).
    """
    import typing

    hints = typing.get_type_hints(schema)
    out: list[str] = []
    for f in dataclasses.fields(schema):
        if isinstance(values, Mapping):
            if f.name not in values:
                continue
            value = values[f.name]
        elif hasattr(values, f.name):
            value = getattr(values, f.name)
        else:
            continue
        path = f"{prefix}{f.name}"
        lim = f.metadata.get(KEY)
        if isinstance(lim, Limit):
            default = f.default if f.default is not dataclasses.MISSING else None
            msg = lim.problem(key(path), value, default=default)
            if msg:
                out.append(msg)
        elif dataclasses.is_dataclass(hints.get(f.name)) and value is not None:
            out.extend(limit_problems(hints[f.name], value, key=key, prefix=f"{path}."))
    return out
