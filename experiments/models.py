"""Models for the trainer: the classes live in :mod:`robustagg.models` (re-exported here so existing
imports keep working); :func:`build_model` maps the ``model.name`` switch onto them."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from robustagg.errors import ConfigError
from robustagg.models import MLP, SmallCNN

__all__ = ["MLP", "SmallCNN", "build_model"]


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
