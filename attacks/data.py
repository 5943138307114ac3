"""Data attacks: the Byzantine worker poisons its data and then trains honestly on it."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError, ShapeError

from .base import Attack, Kind, Knowledge
from .registry import register

__all__ = ["LabelFlip"]


@register("label_flip")
class LabelFlip(Attack):
    r"""Label flipping: the Byzantine workers train on labels ``y -> C - 1 - y``.

    Definition: for a classification task with ``C`` classes, :meth:`poison_labels` maps every
    label ``y`` in ``{0, ..., C - 1}`` to ``C - 1 - y`` (an involution: class 0 <-> C - 1, ...).

    How it is applied (``kind = data``): the trainer applies :meth:`poison_labels` to the Byzantine
    workers' batches, then computes their gradient honestly on the poisoned data and passes it as
    ``own``. ``attack(honest, f, own=own)`` then returns ``own`` unchanged (a copy), so the same
    gradient hook serves data and gradient attacks. The trainer must check
    ``attack.kind is Kind.DATA`` and poison the labels: without that, the call returns honest
    gradients (no attack).

    Knowledge: ``own`` (its own data; nothing about the honest workers).

    Shape: ``poison_labels``: any integer tensor ``(...)`` -> same shape, dtype and device.
    ``__call__``: ``own (f, d) -> (f, d)``.

    Raises:
        ConfigError: ``own`` missing in ``__call__``; ``num_classes`` not an integer >= 1.
        ShapeError: ``y`` not an integer tensor, or a label outside ``[0, C)``.

    Note:
        Public code also flips to a fixed target class, to ``(y + 1) mod C``, or flips only a
        fraction of the labels; this is the ``C - 1 - y`` variant (``9 - y`` on 10 classes).

    Example:
        >>> import torch, attacks
        >>> attacks.LabelFlip().poison_labels(torch.tensor([0, 3, 9]), 10)
        tensor([9, 6, 0])

    References:
        Used as "LF" with ``9 - y`` by Karimireddy, He, Jaggi, "Learning from history for
        Byzantine robust optimization", ICML 2021, and Allouah et al., AISTATS 2023.
    """

    uses_gram = False  # statistics only: no distances

    knowledge = Knowledge.OWN
    kind = Kind.DATA
    paper = "Karimireddy, He, Jaggi, ICML 2021"

    @staticmethod
    def poison_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """Return ``num_classes - 1 - y`` (a new tensor); see the class docstring."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ConfigError(f"LabelFlip: num_classes must be an integer >= 1; got {num_classes!r}.")
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise ShapeError(f"LabelFlip: y must be an integer tensor of class indices; got "
                             f"{y.dtype if isinstance(y, torch.Tensor) else type(y).__name__}.")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ShapeError(f"LabelFlip: labels must lie in [0, {num_classes}); got min {int(y.min())}, "
                             f"max {int(y.max())}. Check num_classes.")
        return (num_classes - 1) - y

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert own is not None
        return own.clone()

    def _params(self) -> dict[str, Any]:
        return {}
