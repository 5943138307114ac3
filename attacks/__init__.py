"""attacks: the zoo of what Byzantine workers submit.

Every attack is a callable ``attack(honest, num_byzantine, *, own=None, rule=None, generator=None,
parameters=None)``
returning the ``(num_byzantine, d)`` Byzantine rows, finite, with the dtype and device of the honest
rows ``(h, d)``. Each class states what it knows (:class:`Knowledge`) and whether it replaces a
gradient or poisons data (:class:`Kind`). Build by name with :func:`get` or with Hydra
(``_target_: attacks.ALIE``)::

    >>> import torch, attacks
    >>> honest = torch.tensor([[1.0, 0.0], [2.0, 4.0], [3.0, 2.0], [2.0, 1.0], [2.0, 3.0]])
    >>> attacks.get("sign_flip")(honest, 2)
    tensor([[-2., -2.],
            [-2., -2.]])
    >>> attacks.get("alie").knowledge.value, attacks.get("agr_tailored").knowledge.value
    ('honest', 'honest+rule')

``robustagg`` never imports this package; the trainer is handed an attack as a callable.
"""

from .alie import ALIE, alie_z
from .backdoor import Backdoor, BackdoorDBA, ModelReplacement
from .base import Attack, Kind, Knowledge, ModelAwareAttack
from .data import LabelFlip
from .fang import FangKrum, FangTrimmedMean
from .mimic import Mimic
from .model_aware import MPAF, PoisonedFL
from .optimal import OptALIE, OptIPM
from .registry import available, get, lookup, register
from .shejwalkar import AGRTailored, MinMax, MinSum
from .simple import IPM, BitFlip, Constant, Gaussian, LargeNorm, SignFlip, Zero

__all__ = [
    "Attack", "Knowledge", "Kind", "available", "get", "lookup", "register",
    "SignFlip", "BitFlip", "Gaussian", "Zero", "Constant", "LargeNorm", "ALIE", "alie_z", "IPM",
    "MinMax", "MinSum", "FangKrum", "FangTrimmedMean", "AGRTailored", "Mimic", "LabelFlip",
    "OptALIE", "OptIPM", "Backdoor", "BackdoorDBA", "ModelReplacement", "MPAF", "PoisonedFL", "ModelAwareAttack",
]
