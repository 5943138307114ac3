"""One type check for every setting: a value against the type its schema declares, in one line.

The schema is wherever the setting is declared, and nowhere else:

- a key below a typed node of :class:`experiments.config.TrainConfig` (``threat.n``,
  ``trainer.mode``, ``data.alpha``...): the dataclass field's annotation
  (:func:`schema_types`);
- a parameter of a ``_target_`` node (``optimizer.lr``, ``aggregator.f``, ``attack.z``,
  ``scheduler.T_max``...): the annotation of that parameter in the class's signature, or, where
  there is none, the type of its default (:func:`target_types`).

:func:`type_problem` is the check itself (``""`` or the message: the key, the value, the type or
the options, and an example). :func:`check_override_types` runs it on the command line before
Hydra composes (Hydra's own message for ``threat.n=six`` spans seven lines and never lists the
options of an enum); :func:`check_tree_types` on a whole configuration tree against the schema
(what :func:`experiments.wiring.as_config` merges); :func:`check_target_types` on a ``_target_``
node before it is built (``optimizer.lr=fast`` reached ``float('fast')`` before). Range checks
(``threat.n >= 1``) are not here: they belong to the object that makes the assumption.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import inspect
import types
import typing
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["type_text", "type_problem", "schema_types", "target_types", "check_override_types", "check_tree_types",
           "check_target_types"]

_NONE = type(None)


def _args(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType)


def _open(tp: Any) -> bool:
    """True when ``tp`` does not constrain a config value (``Any``, no annotation, a callable, a type variable)."""
    return (tp is Any or tp is inspect.Parameter.empty or isinstance(tp, (str, typing.TypeVar))
            or typing.get_origin(tp) is collections.abc.Callable or tp is object)


def type_text(tp: Any) -> str:
    """How a type reads in a message: ``int`` -> "an integer", ``Mode`` -> "one of processes, simulated"."""
    if _is_union(tp):
        parts = [a for a in _args(tp) if a is not _NONE and _text_known(a)]
        text = " or ".join(dict.fromkeys(type_text(a) for a in parts)) or "a value"
        return text + (" or null" if _NONE in _args(tp) else "")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(str(a) for a in _args(tp))
    origin = typing.get_origin(tp)
    if origin in (list, tuple, collections.abc.Sequence):
        inner = [a for a in _args(tp) if a is not Ellipsis]
        return "a list [...]" + (f" of {type_text(inner[0])} each" if inner and not _open(inner[0]) else "")
    if origin in (dict, collections.abc.Mapping):
        return "a mapping {...}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(
        tp, "__name__", str(tp)))


def _text_known(tp: Any) -> bool:
    """A type a config value can have (a class such as ``torch.Tensor`` never is one)."""
    return (tp in (bool, int, float, str) or _is_union(tp) or typing.get_origin(tp) is not None
            or (isinstance(tp, type) and issubclass(tp, enum.Enum)))


def _fits(value: Any, tp: Any, converts: bool = True) -> bool:
    """Whether a config value (scalar, list, mapping, ``None``) can be given where ``tp`` is declared.

    An integer fits a float. With ``converts`` (a typed schema node, which OmegaConf converts on
    assignment) also a string that reads as a number fits a number, ``"true"`` fits a bool and any
    scalar fits a string; a ``_target_`` parameter is passed as it is, so there it does not. A
    ``${...}`` interpolation or ``???`` fits anything (it is resolved or reported later).
    """
    if isinstance(value, str) and (value.startswith("${") or value == "???"):
        return True
    if _open(tp):
        return True
    if _is_union(tp):
        return any(_fits(value, a, converts) for a in _args(tp))
    if tp is _NONE:
        return value is None
    if value is None:
        return False
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or str(value) in {m.name for m in tp} | {str(m.value) for m in tp}
    if typing.get_origin(tp) is typing.Literal:
        return value in _args(tp)
    if tp is bool:
        return isinstance(value, bool) or (converts and isinstance(value, str) and value.lower() in ("true", "false"))
    if tp in (int, float):
        if isinstance(value, bool):
            return False
        if isinstance(value, (int, float)) and not (tp is int and isinstance(value, float) and not value.is_integer()):
            return True
        if isinstance(value, str) and converts:
            try:
                tp(value)
            except ValueError:
                return False
            return True
        return False
    if tp is str:
        return isinstance(value, (str, enum.Enum)) or (converts and isinstance(value, (int, float, bool)))
    origin = typing.get_origin(tp)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.Iterable):
        if not (isinstance(value, (list, tuple)) or _is_list_config(value)):
            return False
        inner = [a for a in _args(tp) if a is not Ellipsis]
        return not inner or all(_fits(v, inner[0], converts) for v in value)
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping)
    if isinstance(tp, type):
        # another class (a tensor, a generator, a module): a config value is one only as a _target_ node
        return isinstance(value, (tp, Mapping))
    return True


def _is_list_config(value: Any) -> bool:
    from omegaconf import ListConfig

    return isinstance(value, ListConfig)


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def type_problem(key: str, value: Any, tp: Any, *, owner: str = "", example: Any = dataclasses.MISSING,
                 converts: bool = True) -> str:
    """``""`` when ``value`` fits the declared type ``tp``, else the one-line message for ``key=value``.

    Args:
        key: the setting as the user types it (``threat.n``, ``optimizer.lr``).
        value: the value given (a string, a number, a list ...).
        tp: the declared type (a dataclass field's or a signature's annotation).
        owner: who declares it, for the message (``torch.optim.SGD``); empty for the schema.
        example: a valid value to suggest (the default), shown when it fits.
        converts: the value is converted on assignment, as in a typed schema node (see :func:`_fits`).

    Returns:
        ``""`` or e.g. ``"trainer.mode=simulate: trainer.mode takes one of processes, simulated (did you
        mean simulated?); got 'simulate'."``.
    """
    if _fits(value, tp, converts):
        return ""
    of = f" ({owner}'s parameter)" if owner else ""
    near = ""
    options = ([str(m.value) for m in tp] if isinstance(tp, type) and issubclass(tp, enum.Enum) else
               [str(a) for a in _args(tp)] if typing.get_origin(tp) is typing.Literal else [])
    if options and isinstance(value, str):
        close = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
        near = f" (did you mean {close[0]}?)" if close else ""
    got = f"the string {value!r}" if isinstance(value, str) else _show(value)
    use = ""
    if example is not dataclasses.MISSING and example is not None and _fits(example, tp) and not isinstance(
            example, (list, dict, enum.Enum)):
        use = f" Use e.g. {key}={_show(example)}."
    elif isinstance(example, enum.Enum):
        use = f" Use e.g. {key}={example.value}."
    return f"{key}={_show(value)}: {key}{of} takes {type_text(tp)}{near}; got {got}.{use}"


def schema_types(schema: type, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf setting below the dataclass ``schema``: ``{dotted path: (annotation, default)}``.

    Nested dataclass fields are walked (``trainer.checkpoint.every``); fields typed ``Any`` are
    open nodes (a ``_target_`` node, the list of faults) and listed with ``Any``.
    """
    out: dict[str, tuple[Any, Any]] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.update(schema_types(tp, path + "."))  # type: ignore[arg-type]
            continue
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        out[path] = (tp, default)
    return out


def target_types(target: Any) -> dict[str, tuple[Any, Any]]:
    """The parameters of the class or function ``target``: ``{name: (annotation, default)}``.

    The annotation comes from the signature (resolved with :func:`typing.get_type_hints` where the
    module allows it); a parameter without one is typed by its default when that is a number, a
    bool or a string (a number's default types it as "a number": ``momentum=0`` takes ``0.9``).
    """
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # an annotation the module cannot resolve: fall back on the defaults
        hints = {}
    out: dict[str, tuple[Any, Any]] = {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = p.default if p.default is not p.empty else dataclasses.MISSING
        tp = hints.get(name, Any)
        if tp is Any and default is not dataclasses.MISSING:
            tp = (bool if isinstance(default, bool) else float if isinstance(default, (int, float))
                  else str if isinstance(default, str) else Any)
        out[name] = (tp, default)
    return out


def check_override_types(overrides: Sequence[str], schema: type) -> None:
    """Refuse a command-line ``key=value`` whose value does not fit the schema's type of ``key``.

    Parsed as Hydra parses them (``threat.n=4,six`` checks both values of the sweep); keys that
    are not typed leaves of ``schema`` (group choices, ``_target_`` nodes, ``hydra.*``, flags) are
    left to the other checks.

    Raises:
        ConfigError: the first value that does not fit, with the key, the value and the type or options.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from robustagg.errors import ConfigError

    leaves = schema_types(schema)
    candidates = [o for o in overrides if "=" in o and not o.startswith("-") and o.partition("=")[0].lstrip(
        "+~") in leaves]
    if not candidates:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # a syntax error: Hydra reports it with its own message
        return
    for o in parsed:
        if o.is_delete():
            continue
        tp, default = leaves[o.key_or_group]
        values: Iterable[Any] = o.sweep_iterator() if o.is_sweep_override() else [o.value()]
        for v in values:
            problem = type_problem(o.key_or_group, v, tp, example=default)
            if problem:
                raise ConfigError(problem)


def check_tree_types(tree: Mapping[str, Any], schema: type) -> None:
    """Check every leaf of the plain configuration ``tree`` that ``schema`` types (see :func:`schema_types`).

    Raises:
        ConfigError: the first leaf whose value does not fit its declared type.
    """
    from robustagg.errors import ConfigError

    leaves = schema_types(schema)

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, Mapping):
            return
        for k, v in node.items():
            path = f"{prefix}{k}"
            if path in leaves:
                tp, default = leaves[path]
                problem = type_problem(path, v, tp, example=default)
                if problem:
                    raise ConfigError(problem)
            elif isinstance(v, Mapping):
                walk(v, path + ".")

    walk(tree, "")


def check_target_types(node: Optional[Mapping[str, Any]], key: str, target: Optional[Any] = None) -> None:
    """Check the parameters of the ``_target_`` node ``node`` (under ``key``) against its target's signature.

    Args:
        node: the node (``_target_``, ``_partial_`` and the parameters); ``None`` or no ``_target_``: nothing.
        key: where it sits in the configuration (``optimizer``), for the message.
        target: the class or function, when the caller resolved it already.

    Raises:
        ConfigError: a parameter whose value does not fit, e.g. ``optimizer.lr=fast: optimizer.lr
            (torch.optim.SGD's parameter) takes a number; got the string 'fast'. Use e.g. optimizer.lr=0.001.``
    """
    from robustagg.errors import ConfigError

    if not isinstance(node, Mapping) or not node.get("_target_"):
        return
    if target is None:
        from hydra.utils import get_method

        try:
            target = get_method(str(node["_target_"]))
        except Exception:
            return  # an unknown target is reported where the node is built, with the options
    owner = str(node["_target_"])
    params = target_types(target)
    for name, value in node.items():
        if str(name).startswith("_") or name not in params:
            continue
        tp, default = params[name]
        problem = type_problem(f"{key}.{name}", value, tp, owner=owner, example=default, converts=False)
        if problem:
            raise ConfigError(problem)
