"""The shell every attack shares: knowledge model, calling convention, validation, state.

An attack maps what the Byzantine workers know at one step to the ``num_byzantine`` rows they
submit. The shell validates the inputs (shape, dtype, finiteness, what the knowledge model needs),
returns an empty ``(0, d)`` tensor when there is no Byzantine worker, and casts the crafted rows
back to the honest rows' dtype and device, saturating values that the dtype cannot hold so that the
output is always finite for finite inputs.
"""

from __future__ import annotations

import abc
import enum
import math
import operator
from typing import Any, Callable, ClassVar, Optional

import torch

from robustagg import as_matrix, check_finite
from robustagg.errors import ConfigError, ShapeError

__all__ = ["Knowledge", "Kind", "Attack", "ModelAwareAttack", "finite_float", "positive_float", "choice"]


class Knowledge(str, enum.Enum):
    """What a Byzantine worker knows when it crafts its row.

    ``NONE``: nothing but the shapes; ``OWN``: its own honestly computed gradient (``own=``);
    ``HONEST``: every honest submission of the step (omniscient); ``HONEST_RULE``: the honest
    submissions and the defender's rule object (``rule=``), e.g. to search against it.
    """

    NONE = "none"
    OWN = "own"
    HONEST = "honest"
    HONEST_RULE = "honest+rule"


class Kind(str, enum.Enum):
    """``GRADIENT``: the attack replaces the submitted gradient; ``DATA``: it poisons the data the
    Byzantine worker then trains on honestly (the trainer applies it to the data loader)."""

    GRADIENT = "gradient"
    DATA = "data"


def finite_float(value: object, name: str, attack: str) -> float:
    """Validate a finite real number; raise :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"{attack}: {name} must be a finite number; got {value!r}.")
    return float(value)


def positive_float(value: object, name: str, attack: str) -> float:
    """Validate a strictly positive finite number; raise :class:`ConfigError` naming ``name``."""
    v = finite_float(value, name, attack)
    if v <= 0:
        raise ConfigError(f"{attack}: {name} must be > 0; got {value!r}.")
    return v


def choice(value: object, name: str, attack: str, options: tuple[str, ...]) -> str:
    """Validate that ``value`` is one of ``options`` (an Enum member with a str value is accepted)."""
    v = value.value if isinstance(value, enum.Enum) else value
    if not isinstance(v, str) or v not in options:
        raise ConfigError(f"{attack}: {name} must be one of {', '.join(repr(o) for o in options)}; got {value!r}.")
    return v


def _num_byzantine(value: object) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"num_byzantine must be a non-negative integer; got {value!r}.")
    try:
        f = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"num_byzantine must be a non-negative integer; got {value!r}.") from None
    if f < 0:
        raise ConfigError(f"num_byzantine must be a non-negative integer; got {f}.")
    return f


class Attack(abc.ABC):
    """Base class of the attacks: ``attack(honest, num_byzantine, ...)`` -> the Byzantine rows.

    Subclasses set the class attributes and implement :meth:`_craft` (the math on validated
    inputs; it may return any floating dtype, the shell casts).

    Calling:
        ``attack(honest, num_byzantine, *, own=None, rule=None, generator=None, parameters=None)``

        - ``honest``: ``(h, d)`` floating tensor (any dtype, any device), the honest submissions
          of the step, in a stable order (e.g. by rank). Attacks whose knowledge model excludes the
          honest rows read only ``h``, ``d``, dtype and device from it, never its values.
        - ``num_byzantine``: ``f >= 0``, the number of rows to craft; the total is
          ``n = h + num_byzantine``.
        - ``own``: ``(num_byzantine, d)`` the Byzantine workers' own honestly computed gradients,
          same dtype and device as ``honest``; required when :attr:`knowledge` is ``OWN``.
        - ``rule``: the defender's aggregator (a callable ``(n, d) -> (d,)``, e.g. a robustagg
          rule or Pipeline); required when :attr:`knowledge` is ``HONEST_RULE``.
        - ``generator``: a seeded :class:`torch.Generator` for randomised attacks (``None``: the
          global torch RNG). Same inputs and generator state give the same bits on one device.
        - ``parameters``: ``(d,)`` the current model parameters, flattened in the order of the
          gradient coordinates (any floating dtype; same device as ``honest``); required when
          :attr:`needs_parameters` is True, ignored otherwise.

    Returns:
        (torch.Tensor): a new ``(num_byzantine, d)`` tensor, dtype and device of ``honest``; ``(0, d)`` when
        ``num_byzantine == 0``. Always finite for finite inputs: values beyond the dtype's range
        are saturated to ``+-torch.finfo(dtype).max``.

    Raises:
        ShapeError: ``honest`` is not a non-empty ``(h, d)`` floating tensor, or ``own`` is not
            ``(num_byzantine, d)`` with the dtype and device of ``honest``.
        NonFiniteInputError: ``honest`` or ``own`` holds NaN or inf (the message names the rows).
        ConfigError: ``num_byzantine`` is not an integer >= 0; ``own`` or ``rule`` is missing
            while the knowledge model needs it; ``parameters`` is missing while
            :attr:`needs_parameters` is True; ``generator`` is not a ``torch.Generator``.
        ShapeError: ``parameters`` is not a floating ``(d,)`` tensor.
        NonFiniteInputError: ``parameters`` holds NaN or inf.
    """

    name: ClassVar[str] = ""
    #: What the attack reads (an instance may narrow it, e.g. ALIE with ``source="own"``).
    knowledge: Knowledge = Knowledge.NONE
    kind: ClassVar[Kind] = Kind.GRADIENT
    paper: ClassVar[str] = ""
    #: True for attacks with explicit state across steps (:meth:`state_dict`).
    stateful: ClassVar[bool] = False
    #: True for attacks that read the current model parameters (``parameters=``), which every
    #: worker holds in data-parallel training (e.g. MPAF's drag toward a base model).
    needs_parameters: ClassVar[bool] = False
    #: False for attacks whose own computation never builds a Gram matrix or pairwise distances
    #: (statistics, constants, noise): the trainer then skips the Gram kernel's warm-up when the
    #: rule needs none either (see :func:`robustagg.functional.gram.needs_warm_up`). True (the
    #: safe default) warms it up.
    uses_gram: ClassVar[bool] = True

    def __init__(self) -> None:
        """Attacks without hyperparameters take no arguments (unknown ones are refused)."""

    def __call__(self, honest: torch.Tensor, num_byzantine: int, *, own: Optional[torch.Tensor] = None,
                 rule: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 generator: Optional[torch.Generator] = None,
                 parameters: Optional[torch.Tensor] = None) -> torch.Tensor:
        honest = as_matrix(honest, "honest")
        check_finite(honest, "honest")
        f = _num_byzantine(num_byzantine)
        own = self._check_own(own, honest, f)
        if self.knowledge is Knowledge.HONEST_RULE:
            if rule is None:
                raise ConfigError(f"{type(self).__name__} is rule-aware: pass rule= (the defender's aggregator "
                                  "object, e.g. robustagg.get('trimmed_mean', f=2)).")
        if rule is not None and not callable(rule):
            raise ConfigError(f"rule must be a callable aggregator (n, d) -> (d,); got {rule!r}.")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ConfigError(f"generator must be a torch.Generator or None; got {generator!r}.")
        d = honest.shape[1]
        w = self._check_parameters(parameters, d) if self.needs_parameters else None
        if f == 0:
            return honest.new_zeros((0, d))
        if w is not None:
            assert isinstance(self, ModelAwareAttack)
            out = self._craft_model(honest, f, w.to(honest.device), own=own, generator=generator)
        else:
            out = self._craft(honest, f, own=own, rule=rule, generator=generator)
        return self._finish(out, honest, f)

    def _check_own(self, own: Optional[torch.Tensor], honest: torch.Tensor, f: int) -> Optional[torch.Tensor]:
        if own is None:
            if self.knowledge is Knowledge.OWN:
                raise ConfigError(f"{type(self).__name__} uses the Byzantine workers' own gradients: pass own= "
                                  f"(a ({f}, {honest.shape[1]}) tensor of their honestly computed gradients).")
            return None
        if not isinstance(own, torch.Tensor) or own.dim() != 2 or tuple(own.shape) != (f, honest.shape[1]):
            shape = tuple(own.shape) if isinstance(own, torch.Tensor) else type(own).__name__
            raise ShapeError(f"own must have shape (num_byzantine, d) = ({f}, {honest.shape[1]}); got {shape}.")
        if own.dtype != honest.dtype or own.device != honest.device:
            raise ShapeError(f"own must have the dtype and device of honest ({honest.dtype}, {honest.device}); got "
                             f"({own.dtype}, {own.device}). Convert with own.to(honest).")
        check_finite(own, "own")
        return own

    def _check_parameters(self, parameters: Optional[torch.Tensor], d: int) -> torch.Tensor:
        """Validate ``parameters`` as a finite floating ``(d,)`` tensor; return it as float64."""
        if parameters is None:
            raise ConfigError(f"{type(self).__name__} reads the current model: pass parameters= (the ({d},) "
                              "flattened model parameters, in the order of the gradient coordinates).")
        if (not isinstance(parameters, torch.Tensor) or not parameters.is_floating_point()
                or tuple(parameters.shape) != (d,)):
            got = (f"{tuple(parameters.shape)} {parameters.dtype}" if isinstance(parameters, torch.Tensor)
                   else type(parameters).__name__)
            raise ShapeError(f"parameters must be a floating tensor of shape (d,) = ({d},); got {got}.")
        w = parameters.detach().to(torch.float64)
        check_finite(w.unsqueeze(0), "parameters")
        return w

    @abc.abstractmethod
    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        """The math: ``(f, d)`` or ``(d,)`` (broadcast to every Byzantine row) on validated inputs."""

    def _finish(self, out: torch.Tensor, honest: torch.Tensor, f: int) -> torch.Tensor:
        """Broadcast to ``(f, d)``, saturate to the dtype's finite range, cast, copy."""
        d = honest.shape[1]
        if out.dim() == 1:
            out = out.unsqueeze(0).expand(f, d)
        if tuple(out.shape) != (f, d):  # pragma: no cover - guards subclasses
            raise RuntimeError(f"internal error: {type(self).__name__} produced shape {tuple(out.shape)}, "
                               f"expected {(f, d)}.")
        big = torch.finfo(honest.dtype).max
        out = out.clamp(-big, big).to(dtype=honest.dtype, device=honest.device).contiguous()
        if not bool(torch.isfinite(out).all()):  # pragma: no cover - a bug, never a silent NaN
            raise RuntimeError(f"internal error: {type(self).__name__} produced non-finite values from finite "
                               "inputs; please report it.")
        return out

    # --- state (only stateful attacks override) ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The attack's explicit state, tagged with its name (``{"attack": name}`` when stateless)."""
        return {"attack": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ConfigError: the state belongs to another attack.
        """
        if not isinstance(state, dict) or state.get("attack") != self.name:
            got = state.get("attack") if isinstance(state, dict) else state
            raise ConfigError(f"{type(self).__name__}: cannot load the state of attack {got!r}.")

    def reset(self) -> None:
        """Forget any state (no-op for stateless attacks)."""

    def _params(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


class ModelAwareAttack(Attack):
    """Base of the attacks that read the current model parameters (``needs_parameters = True``).

    Subclasses implement :meth:`_craft_model` instead of ``_craft``; the shell validates
    ``parameters`` (a finite floating ``(d,)`` tensor, refused with a message naming it when
    missing) and hands it over as float64 on the honest rows' device.
    """

    needs_parameters: ClassVar[bool] = True

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:  # pragma: no cover - never called
        raise RuntimeError(f"internal error: {type(self).__name__} crafts from the parameters (_craft_model).")

    @abc.abstractmethod
    def _craft_model(self, honest: torch.Tensor, f: int, w: torch.Tensor, *, own: Optional[torch.Tensor],
                     generator: Optional[torch.Generator]) -> torch.Tensor:
        """The math from the float64 ``(d,)`` parameters ``w``: ``(f, d)`` or ``(d,)``."""
