"""Training protocols: which submissions enter an update, what each is, how the server applies it.

``DSGD`` (synchronous data-parallel SGD) is the default. See :mod:`robustagg.protocols.base`
for the seam and ``docs/protocols.md`` for what each protocol guarantees and gives up.
"""

from .base import Protocol, RoundPlan
from .dsgd import DSGD
from .redundant import Redundant

__all__ = ["Protocol", "RoundPlan", "DSGD", "Redundant"]
