"""Attacks of decentralised learning: a Byzantine node sends each honest neighbour its own message.

In gossip nobody sees every message, so a Byzantine node tailors what it sends to each receiver:
the attack is computed against that receiver's *view*: its own model ``x_i`` and the models its
honest neighbours sent it. Every attack here is finite by construction (the messages are affine
in honest models).

An attack is called once per honest receiver ``i`` that has Byzantine neighbours::

    messages = attack(own, honest, w_honest, w_byzantine, senders, generator=g)  # (b, d)

with ``own`` ``(d,)`` the receiver's model, ``honest`` ``(h, d)`` its honest neighbours' messages,
``w_honest`` ``(h,)`` and ``w_byzantine`` ``(b,)`` float64 its gossip weights of them, ``senders``
``(b, d)`` the models the ``b`` Byzantine neighbours computed honestly (what they would have sent),
and ``generator`` the attack's seeded torch generator. It returns one message per Byzantine
neighbour, ascending neighbour id, in ``own``'s dtype.

    >>> import torch
    >>> from attacks.gossip import Dissensus
    >>> own = torch.tensor([0.0]); honest = torch.tensor([[2.0]])
    >>> w_h = torch.tensor([0.25], dtype=torch.float64); w_b = torch.tensor([0.25], dtype=torch.float64)
    >>> Dissensus(epsilon=1.0)(own, honest, w_h, w_b, torch.zeros(1, 1))  # cancels the honest pull
    tensor([[-2.]])
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional

import torch

from robustagg.errors import ConfigError

from .alie import alie_z

__all__ = ["GossipAttack", "Dissensus", "GossipALIE", "GossipIPM", "GossipSignFlip", "Split", "GOSSIP_ATTACKS",
           "build_gossip_attack"]


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < float("inf"):
        raise ConfigError(f"attack.{name} must be a positive finite number; got {value!r}.")
    return float(value)


class GossipAttack(abc.ABC):
    """Base class of the per-receiver attacks (``attack=<name>`` under ``protocol=gossip``)."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: what the apps read to route it (``attack=<name>`` needs ``protocol=gossip``).
    kind: ClassVar[str] = "gossip"
    #: the attack needs the two halves of the honest nodes (:class:`Split`).
    needs_sides: ClassVar[bool] = False

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, w_honest: torch.Tensor, w_byzantine: torch.Tensor,
                 senders: torch.Tensor, *, generator: Optional[torch.Generator] = None,
                 side: int = 0, direction: Optional[torch.Tensor] = None) -> torch.Tensor:
        b = w_byzantine.shape[0]
        if senders.shape != (b, own.shape[0]) or honest.dim() != 2 or w_honest.shape != (honest.shape[0],):
            raise ConfigError(f"gossip attack {self.name}: own (d,), honest (h, d), w_honest (h,), senders (b, d); got "
                              f"{tuple(own.shape)}, {tuple(honest.shape)}, {tuple(w_honest.shape)}, "
                              f"{tuple(senders.shape)}.")
        out = self._craft(own.to(torch.float64), honest.to(torch.float64), w_honest, w_byzantine,
                          senders.to(torch.float64), generator=generator, side=side, direction=direction)
        return out.to(own.dtype)

    @abc.abstractmethod
    def _craft(self, own: torch.Tensor, honest: torch.Tensor, w_honest: torch.Tensor, w_byzantine: torch.Tensor,
               senders: torch.Tensor, *, generator: Optional[torch.Generator], side: int,
               direction: Optional[torch.Tensor]) -> torch.Tensor:
        """The ``(b, d)`` float64 messages."""

    def describe(self) -> dict[str, Any]:
        """The attack's name and parameters (for the summary)."""
        return {"attack": self.name}

    def check_view(self, inputs: int, byzantine: int) -> None:
        """Refuse, before launch, a receiver the attack cannot be computed against: one with
        ``inputs`` inputs (its degree + 1) of which ``byzantine`` are Byzantine neighbours.

        Raises:
            ConfigError: naming ``attack.<key>`` and the fix (default: never).
        """


class Dissensus(GossipAttack):
    """The dissensus attack (He, Karimireddy, Jaggi 2022, Sec. 4): every Byzantine neighbour ``j``
    of receiver ``i`` sends ``x_i - epsilon * (sum_{k honest} W_ik (x_k - x_i)) / (sum_{j Byz} W_ij)``,
    so the Byzantine terms of plain gossip add up to ``-epsilon`` times the honest pull: at
    ``epsilon = 1`` the receiver does not move towards its honest neighbours, above 1 it moves away.
    Each message lies at distance ``epsilon ||pull|| / delta_i`` from ``x_i``.

    Raises:
        ConfigError: ``epsilon`` not a positive finite number.
    """

    name = "dissensus"
    paper = "He, Karimireddy, Jaggi 2022"

    def __init__(self, *, epsilon: float = 1.05) -> None:
        self.epsilon = _positive(epsilon, "epsilon")

    def _craft(self, own, honest, w_honest, w_byzantine, senders, *, generator, side, direction):
        pull = (w_honest[:, None] * (honest - own)).sum(dim=0)
        msg = own - self.epsilon * pull / float(w_byzantine.sum())
        return msg[None].expand(w_byzantine.shape[0], -1).clone()

    def describe(self) -> dict[str, Any]:
        return {"attack": self.name, "epsilon": self.epsilon}


class GossipALIE(GossipAttack):
    """A little is enough (Baruch, Baruch, Goldberg, NeurIPS 2019) against one receiver's view:
    ``mu - z sigma`` per coordinate, over the receiver's own model and its honest neighbours'
    messages (``sigma``: the unbiased standard deviation; 0 for a single honest input). ``z=None``
    takes their formula at the receiver's ``n = k + 1`` inputs and ``b`` Byzantine neighbours
    (:func:`attacks.alie.alie_z`).
    """

    name = "gossip_alie"
    paper = "Baruch et al., NeurIPS 2019"

    def __init__(self, *, z: Optional[float] = None) -> None:
        self.z = None if z is None else _positive(z, "z")

    def check_view(self, inputs: int, byzantine: int) -> None:
        if self.z is None and byzantine > 0:
            try:
                alie_z(int(inputs), int(byzantine))
            except Exception as exc:  # the formula's own message, with the key that fixes it
                raise ConfigError(f"attack=gossip_alie with attack.z=null takes Baruch et al.'s z at each receiver, "
                                  f"undefined at a node with {inputs} inputs and {byzantine} Byzantine neighbours "
                                  f"({exc}); pass attack.z=1.0 (or another positive z).") from None

    def _craft(self, own, honest, w_honest, w_byzantine, senders, *, generator, side, direction):
        view = torch.cat([own[None], honest])
        b = w_byzantine.shape[0]
        z = self.z if self.z is not None else alie_z(view.shape[0] + b, b)
        sigma = view.std(dim=0, unbiased=True) if view.shape[0] > 1 else torch.zeros_like(own)
        msg = view.mean(dim=0) - z * sigma
        return msg[None].expand(b, -1).clone()

    def describe(self) -> dict[str, Any]:
        return {"attack": self.name, "z": self.z}


class GossipIPM(GossipAttack):
    """Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2019) against one receiver's view:
    ``-epsilon`` times the mean of the receiver's own model and its honest neighbours' messages.
    """

    name = "gossip_ipm"
    paper = "Xie et al., UAI 2019"

    def __init__(self, *, epsilon: float = 0.1) -> None:
        self.epsilon = _positive(epsilon, "epsilon")

    def _craft(self, own, honest, w_honest, w_byzantine, senders, *, generator, side, direction):
        msg = -self.epsilon * torch.cat([own[None], honest]).mean(dim=0)
        return msg[None].expand(w_byzantine.shape[0], -1).clone()

    def describe(self) -> dict[str, Any]:
        return {"attack": self.name, "epsilon": self.epsilon}


class GossipSignFlip(GossipAttack):
    """Sign flip of the model (the bit-flipping worker of He, Karimireddy, Jaggi 2022's code): each
    Byzantine node sends ``-x_j``, the negation of the model it computed honestly, to every receiver."""

    name = "gossip_sign_flip"
    paper = "He, Karimireddy, Jaggi 2022"

    def _craft(self, own, honest, w_honest, w_byzantine, senders, *, generator, side, direction):
        return -senders


class Split(GossipAttack):
    """The split attack: push two halves of the honest nodes apart. The honest nodes are split in
    two sides (by the sign of the honest subgraph's Fiedler vector, fixed for the run) and
    ``direction`` ``(d,)`` is the unit vector from side 1's mean model to side 0's (a seeded random
    unit vector while they coincide). A receiver on side 0 gets ``x_i + epsilon r_i u``, one on side
    1 ``x_i - epsilon r_i u``, with ``r_i`` the mean distance of its honest neighbours' messages from
    ``x_i``: every message looks like an honest neighbour's (a clipping radius fitted to the
    honest spread lets it through) and all of them pull the two sides apart.

    Raises:
        ConfigError: ``epsilon`` not a positive finite number.
    """

    name = "split"
    paper = "this toolkit"
    needs_sides = True

    def __init__(self, *, epsilon: float = 1.0) -> None:
        self.epsilon = _positive(epsilon, "epsilon")

    def _craft(self, own, honest, w_honest, w_byzantine, senders, *, generator, side, direction):
        if direction is None:
            raise ConfigError("the split attack needs the direction between the two honest sides.")
        r = torch.linalg.vector_norm(honest - own, dim=1).mean() if honest.shape[0] else torch.zeros((), dtype=own.dtype)
        sign = 1.0 if side == 0 else -1.0
        msg = own + sign * self.epsilon * r * direction.to(torch.float64)
        return msg[None].expand(w_byzantine.shape[0], -1).clone()

    def describe(self) -> dict[str, Any]:
        return {"attack": self.name, "epsilon": self.epsilon}


#: ``attack=`` names under ``protocol=gossip`` (``none``: everyone honest; a data attack such as
#: ``label_flip`` also works: it acts through the Byzantine nodes' local steps).
GOSSIP_ATTACKS: dict[str, type[GossipAttack]] = {a.name: a for a in (Dissensus, Split, GossipALIE, GossipIPM,
                                                                     GossipSignFlip)}


def build_gossip_attack(name: str, **params: Any) -> GossipAttack:
    """The gossip attack named ``name`` with its parameters.

    Raises:
        ConfigError: an unknown name (naming the known ones) or a parameter it does not take.
    """
    if name not in GOSSIP_ATTACKS:
        raise ConfigError(f"attack {name!r} has no gossip form; under protocol=gossip choose one of "
                          f"{', '.join(GOSSIP_ATTACKS)} (or a data attack such as label_flip).")
    try:
        return GOSSIP_ATTACKS[name](**params)
    except TypeError as e:
        raise ConfigError(f"attack {name!r}: {e}.") from None
