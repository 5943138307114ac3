"""Training protocols: which submissions enter an update, what each is, how the server applies it.

``DSGD`` (synchronous data-parallel SGD) is the default; ``LocalRounds`` runs rounds of local
training with client sampling (``protocol=local``); ``AsyncSGD`` (``protocol=async``) is
bounded-staleness asynchronous SGD on a seeded virtual clock; ``Redundant`` (``protocol=redundant``)
votes over replica groups; ``Gossip`` (``protocol=gossip``) is decentralised learning on a graph,
one model per node and no server. See :mod:`robustagg.protocols.base`
for the seam and ``docs/protocols.md`` for what each protocol guarantees and gives up.
"""

from .asynchronous import AsyncSGD
from .base import Protocol, RoundPlan
from .dsgd import DSGD
from .gossip import Gossip
from .local import LocalRounds
from .redundant import Redundant

__all__ = ["Protocol", "RoundPlan", "DSGD", "LocalRounds", "AsyncSGD", "Redundant", "Gossip"]
