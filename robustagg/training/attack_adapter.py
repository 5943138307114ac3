"""Hand an attack object (the zoo's contract) to the trainer without losing its state.

The trainer calls a :class:`~robustagg.training.GradientAttack` as ``fn(honest, b, own, generator)``
and checkpoints ``fn.state_dict()``. :class:`AttackAdapter` turns any object with the zoo's call
``attack(honest, b, own=..., rule=..., generator=...)`` and a ``knowledge`` attribute into that, and
forwards ``state_dict`` / ``load_state_dict`` so a stateful attack (mimic's target, a consistent
malicious direction) is part of every committed checkpoint. The library never imports ``attacks``;
the object is duck-typed.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..aggregators.base import Aggregator

__all__ = ["AttackAdapter"]


class AttackAdapter:
    """Adapts an attack object to the trainer's :class:`~robustagg.training.GradientAttack`.

    Rule-aware attacks (``knowledge == "honest+rule"``) receive a deep copy of the defender's
    current rule each step: searching with it must not advance the rule's own state (e.g. centered
    clipping's centre). Model-aware attacks (``needs_parameters``, e.g. MPAF) also receive the
    flattened current parameters ``(d,)`` as ``parameters=``.

    Args:
        attack: an object called as ``attack(honest (h, d), num_byzantine, own=(b, d) | None,
            rule=Aggregator | None, generator=torch.Generator) -> (num_byzantine, d)``, with a
            ``knowledge`` attribute (``"none"``, ``"own"``, ``"honest"``, ``"honest+rule"`` or an
            enum whose ``value`` is one of them) and, when stateful, ``state_dict`` /
            ``load_state_dict``.
        rule: the defender's rule (the trainer's reduction rule; never mutated here).

    Example:
        >>> import torch, robustagg as ra
        >>> class Flip:
        ...     knowledge = "honest"
        ...     def __call__(self, honest, b, own=None, rule=None, generator=None):
        ...         return -honest.mean(0).expand(b, -1)
        >>> AttackAdapter(Flip(), ra.Mean())(torch.ones(3, 2), 2, None, torch.Generator())
        tensor([[-1., -1.],
                [-1., -1.]])
    """

    def __init__(self, attack: Any, rule: Aggregator) -> None:
        self.attack = attack
        self.rule = rule
        self.knowledge = str(getattr(attack.knowledge, "value", attack.knowledge))
        self.rule_aware = self.knowledge == "honest+rule"
        #: the attack reads the current model (``needs_parameters``, e.g. MPAF): the trainer passes it.
        self.needs_parameters = bool(getattr(attack, "needs_parameters", False))

    def __call__(self, honest: torch.Tensor, num_byzantine: int, own: Optional[torch.Tensor],
                 generator: torch.Generator, *, parameters: Optional[torch.Tensor] = None) -> torch.Tensor:
        rule = copy.deepcopy(self.rule) if self.rule_aware else None
        extra = {} if parameters is None else {"parameters": parameters}
        return self.attack(honest, num_byzantine, own=own, rule=rule, generator=generator, **extra)

    def state_dict(self) -> dict[str, Any]:
        """The attack's own state (``{}`` when it has none)."""
        fn = getattr(self.attack, "state_dict", None)
        return dict(fn()) if fn is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into the attack."""
        fn = getattr(self.attack, "load_state_dict", None)
        if fn is not None:
            fn(state)
