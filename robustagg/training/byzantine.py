"""The Byzantine behaviour a trainer is handed (dependency injection: the library never imports attacks/).

A Byzantine worker either replaces its submission (a *gradient* attack) or trains honestly on
poisoned data (a *data* attack, e.g. label flipping). The trainer calls what it is given at the
right moment of the step; what the attack does is the caller's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..aggregators.base import Aggregator
from ..errors import ConfigError
from ..preaggregation.base import PreAggregator

__all__ = ["GradientAttack", "LabelPoison", "BatchPoison", "ByzantineBehaviour"]


class GradientAttack(Protocol):
    """``fn(honest, num_byzantine, own, generator) -> (num_byzantine, d)``.

    The call's arguments:

    - ``honest``: ``(h, d)`` the honest workers' submissions of this step, in rank order (an
      attack whose knowledge model excludes them must only read their shape and dtype). They have
      passed the reduction's non-finite policy first: under ``on_nonfinite=drop`` a NaN/inf honest
      row is left out (``h`` is then smaller than ``n - num_byzantine``), exactly as the rule will
      not see it; under ``abort`` the step stops before the attack is called.
    - ``num_byzantine``: number of rows to craft.
    - ``own``: ``(num_byzantine, d)`` the Byzantine workers' own honestly computed submissions
      (``None`` when the behaviour declares ``needs_exchange=False``).
    - ``generator``: a seeded :class:`torch.Generator` whose state the trainer checkpoints.

    When the behaviour declares ``needs_parameters=True`` the trainer also passes the keyword
    ``parameters=``: the ``(d,)`` current model parameters (before this step's update), flattened
    in the order of the gradient coordinates; otherwise the call is exactly the four arguments
    above (implementations written before the keyword keep working).

    An object implementing it may also have ``state_dict()`` / ``load_state_dict(state)`` (stateful
    attacks such as mimic); the trainer saves and restores them.
    """

    def __call__(self, honest: torch.Tensor, num_byzantine: int, own: Optional[torch.Tensor],
                 generator: torch.Generator) -> torch.Tensor: ...


#: ``poison(labels, num_classes) -> labels``: relabels a Byzantine worker's batch (same shape).
LabelPoison = Callable[[torch.Tensor, int], torch.Tensor]

#: ``poison(x, y, num_classes, index) -> (x, y)``: poisons a Byzantine worker's whole batch (inputs
#: and labels, same shapes and dtypes; e.g. a backdoor trigger); ``index`` is the worker's position
#: among the Byzantine ranks (``0 .. f - 1``, e.g. which part of a distributed trigger it stamps).
BatchPoison = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def _hidden_state(fn: Any) -> Any:
    """A stateful object ``fn`` closes over (or binds) while ``fn`` itself has no ``state_dict``."""
    if fn is None or hasattr(fn, "state_dict"):
        return None
    held: list[Any] = []
    held += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if c.cell_contents is not None]
    held += [getattr(fn, "__self__", None)]
    held += list(getattr(fn, "args", ())) + list(getattr(fn, "keywords", {}).values())  # functools.partial
    held += list(getattr(fn, "__defaults__", None) or ())
    for obj in held:
        if obj is None or isinstance(obj, (type, torch.Tensor, Aggregator, PreAggregator)) \
                or not callable(getattr(obj, "state_dict", None)):
            continue  # the defender's rule is checkpointed by the trainer itself
        if bool(getattr(obj, "stateful", True)):  # objects that declare ``stateful = False`` hold nothing
            return obj
    return None


@dataclass
class ByzantineBehaviour:
    """Which workers are Byzantine and what they do.

    Args:
        ranks: the Byzantine workers' ranks (distinct, in ``[0, n)``).
        gradient_fn: a :class:`GradientAttack` replacing their submissions, or ``None``.
        poison_fn: a :data:`LabelPoison` applied to their batches' labels, or ``None``.
        batch_poison_fn: a :data:`BatchPoison` applied to their batches (inputs and labels, after
            ``poison_fn`` when both are set), or ``None``. A data attack may set it together with
            ``gradient_fn``, which then gets the gradients on the poisoned batches as ``own``
            (e.g. model replacement boosts them).
        start_step: they behave honestly before this step id.
        seed: seed of the generator handed to ``gradient_fn`` (the same on every Byzantine rank,
            so colluding workers craft the same rows in every process).
        name: display name (for logs).
        needs_exchange: ``gradient_fn`` reads the honest rows' or the Byzantine workers' own
            values. ``False`` (attacks that know nothing, e.g. Gaussian noise) skips the exchange:
            ``gradient_fn`` then gets zeros of the honest rows' shape and ``own=None``.
        needs_parameters: ``gradient_fn`` reads the current model: the trainer passes
            ``parameters=`` (see :class:`GradientAttack`). Default ``False``.
        gossip_fn: under a mixing protocol (``protocol=gossip``): the per-receiver attack whose
            messages the Byzantine nodes send each honest neighbour (:mod:`attacks.gossip`), or
            ``None``. The protocol calls it; the trainer never replaces a row with it.

    Raises:
        ConfigError: duplicate or negative ranks, neither callable given while ``ranks`` is
            non-empty (``batch_poison_fn`` counts), or ``gradient_fn`` is a function (lambda,
            closure, bound method, partial) over a stateful attack without a ``state_dict`` of its
            own (its state would silently be missing from checkpoints; wrap the attack in
            :class:`~robustagg.training.AttackAdapter`).

    Note:
        Omniscient attacks need this step's honest submissions: when ``gradient_fn`` is set, the
        trainer exchanges every worker's honestly computed submission first (one extra all-gather
        per step) and then the Byzantine ranks submit ``gradient_fn``'s rows. Every Byzantine rank
        calls ``gradient_fn`` on the same inputs and takes its own row, so a colluding attack is
        computed identically in every process.
    """

    ranks: Sequence[int]
    gradient_fn: Optional[GradientAttack] = None
    poison_fn: Optional[LabelPoison] = None
    start_step: int = 0
    seed: int = 0
    name: str = "byzantine"
    needs_exchange: bool = True
    batch_poison_fn: Optional[BatchPoison] = None
    needs_parameters: bool = False
    gossip_fn: Optional[Any] = None

    def __post_init__(self) -> None:
        self.ranks = tuple(sorted(int(r) for r in self.ranks))
        if len(set(self.ranks)) != len(self.ranks) or any(r < 0 for r in self.ranks):
            raise ConfigError(f"Byzantine ranks must be distinct non-negative ints; got {list(self.ranks)}.")
        if self.ranks and self.gradient_fn is None and self.poison_fn is None and self.batch_poison_fn is None \
                and self.gossip_fn is None:
            raise ConfigError("ByzantineBehaviour needs gradient_fn, poison_fn, batch_poison_fn or gossip_fn when "
                              "ranks is non-empty.")
        hidden = _hidden_state(self.gradient_fn)
        if hidden is not None:
            raise ConfigError(f"gradient_fn wraps {type(hidden).__name__}, which has state (state_dict), but "
                              f"gradient_fn itself has no state_dict: checkpoints would silently drop that state. "
                              f"Pass robustagg.training.AttackAdapter(attack, rule), or give gradient_fn "
                              f"state_dict/load_state_dict methods that forward to it.")

    def active(self, step: int) -> bool:
        """True when the Byzantine workers attack at ``step``."""
        return bool(self.ranks) and step >= self.start_step

    def state_dict(self) -> dict[str, Any]:
        """The injected attack's own state (``{}`` when it has none)."""
        fn: Any = self.gradient_fn
        return dict(fn.state_dict()) if fn is not None and hasattr(fn, "state_dict") else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into the injected attack."""
        fn: Any = self.gradient_fn
        if state and fn is not None and hasattr(fn, "load_state_dict"):
            fn.load_state_dict(state)
