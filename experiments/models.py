"""Models for the trainer: the classes live in :mod:`robustagg.models` (re-exported here so existing
imports keep working).

``model`` is a Hydra ``_target_`` node (``conf/model/``): any ``nn.Module`` class or factory.
:func:`instantiate_model` fills the arguments that depend on the data when the constructor takes
them and the config leaves them out: ``input_shape`` / ``image_shape`` (one example's shape, e.g.
``(3, 32, 32)``), ``in_features`` (its product) and ``num_classes``. :func:`build_model` is the
former ``model.name`` switch (``mlp``, ``cnn``), kept for scripts.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping, Sequence

from torch import nn

from robustagg.errors import ConfigError
from robustagg.models import MLP, SmallCNN

__all__ = ["MLP", "SmallCNN", "build_model", "instantiate_model", "data_arguments"]


def build_model(name: str, *, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64,),
                channels: Sequence[int] = (8, 16), dropout: float = 0.0) -> nn.Module:
    """Build ``mlp`` or ``cnn`` for inputs of ``input_shape`` and ``num_classes`` classes.

    Raises:
        ConfigError: unknown name (lists ``mlp``, ``cnn``) or a CNN on non-image data.
    """
    if name == "mlp":
        d = 1
        for s in input_shape:
            d *= int(s)
        return MLP(d, list(hidden), num_classes, dropout=dropout)
    if name == "cnn":
        return SmallCNN(input_shape, list(channels), num_classes)
    raise ConfigError(f"unknown model {name!r}; available: cnn, mlp.")


def _target(node: Mapping[str, Any], what: str) -> Any:
    target = node.get("_target_") if node is not None else None
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{what} needs a _target_ (choose {what}=NAME from conf/{what}/, or set {what}._target_ "
                          f"to a class such as my.module.Net).")
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as exc:
        raise ConfigError(f"{what}._target_={target!r} cannot be imported: {exc}".replace("\n", " ")) from None


def _parameters(obj: Any) -> tuple[list[str], bool]:
    """Named parameters of a class's constructor or a function, and whether it takes ``**kwargs``."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def data_arguments(obj: Any, given: Sequence[str], *, input_shape: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The data-dependent arguments ``obj`` takes and the config did not give.

    Args:
        obj: a class or function. given: the keys the config sets.
        input_shape: one example's shape (e.g. ``(1, 28, 28)``). num_classes: C.

    Returns:
        a subset of ``{"input_shape": tuple, "image_shape": tuple, "in_features": int, "num_classes": int}``.
    """
    names, _ = _parameters(obj)
    shape = tuple(int(s) for s in input_shape)
    known = {"input_shape": shape, "image_shape": shape, "in_features": math.prod(shape), "num_classes": int(num_classes)}
    return {k: v for k, v in known.items() if k in names and k not in given}


def instantiate_model(node: Mapping[str, Any], *, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Build the ``model`` node for inputs of ``input_shape`` and ``num_classes`` classes.

    Args:
        node: ``_target_`` (an ``nn.Module`` class or a function returning one) and its arguments.
        input_shape: one example's shape. num_classes: C.

    Returns:
        the module (its parameters drawn from torch's default generator: seed it first).

    Raises:
        ConfigError: no or unimportable ``_target_``, an argument the constructor does not take
            (the message lists the ones it does), a constructor error (e.g. a CNN on vector data),
            or a result that is not an ``nn.Module``.
    """
    obj = _target(node, "model")
    params = {k: v for k, v in dict(node).items() if k not in ("_target_", "_partial_", "_convert_", "_recursive_")}
    names, var_kw = _parameters(obj)
    unknown = [k for k in params if k not in names]
    if unknown and not var_kw:
        raise ConfigError(f"model {node.get('_target_')} does not take {', '.join(repr(k) for k in unknown)}; its "
                          f"parameters are {', '.join(names) or '(none)'}.")
    from hydra.utils import instantiate

    extra = data_arguments(obj, list(params), input_shape=input_shape, num_classes=num_classes)
    try:
        model = instantiate(dict(node), _convert_="all", **extra)
    except ConfigError:
        raise
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        raise ConfigError(f"model {node.get('_target_')}: {exc}".replace("\n", " ")) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={node.get('_target_')!r} returned {type(model).__name__}, not an nn.Module.")
    return model
