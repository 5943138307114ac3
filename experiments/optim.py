"""The ``optimizer`` and ``scheduler`` config nodes -> torch objects (wiring only).

Both groups hold Hydra ``_target_`` nodes with ``_partial_: true`` (``conf/optimizer/``,
``conf/scheduler/``), so any ``torch.optim`` optimizer or ``torch.optim.lr_scheduler`` scheduler
(or your own class with the same calling convention) works by override:
``optimizer._target_=torch.optim.RMSprop``. The optimizer is called with the model's parameters,
the scheduler with the optimizer; a scheduler node with ``_target_: null`` (``scheduler=none``)
keeps the learning rate constant. The trainer steps the scheduler once per optimizer step, and
both state dicts are checkpointed.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch.optim import Optimizer

from robustagg.errors import ConfigError

__all__ = ["build_optimizer", "build_scheduler", "MOVED_KEYS", "moved_keys"]

def _moved() -> dict[str, str]:
    from .config import moved_settings

    return {k.removeprefix("trainer."): v for k, v in moved_settings().items() if k.startswith("trainer.")}


#: trainer.* keys that moved, and where to (from the schema's metadata: experiments.config.TrainerConf).
MOVED_KEYS = _moved()


def moved_keys(trainer: Mapping[str, Any]) -> None:
    """Refuse the former ``trainer.lr/momentum/weight_decay/nesterov/scheduler`` keys with one message.

    Raises:
        ConfigError: one of them is set; the message names each new key.
    """
    used = [k for k in MOVED_KEYS if trainer.get(k) is not None]
    if used:
        moves = "; ".join(f"trainer.{k}={trainer.get(k)} -> {MOVED_KEYS[k]}" for k in used)
        raise ConfigError(f"the server optimizer and schedule moved out of trainer: {moves} (choose the optimizer "
                          f"with optimizer=sgd|adam|adamw; conf/optimizer/, conf/scheduler/).")


def _call(node: Mapping[str, Any], what: str, arg: Any) -> Any:
    from hydra.utils import instantiate

    if node.get("_partial_") is not True:
        raise ConfigError(f"{what} needs _partial_: true (it is called with the "
                          f"{'model parameters' if what == 'optimizer' else 'optimizer'}); got {dict(node)}.")
    try:
        factory = instantiate(dict(node), _convert_="all")
        return factory(arg)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{what} {node.get('_target_')}: {exc}".replace("\n", " ")) from None


def build_optimizer(node: Optional[Mapping[str, Any]], params: Iterable[torch.nn.Parameter]) -> Optimizer:
    """The configured optimizer over ``params`` (the server step applied to the robust aggregate).

    Raises:
        ConfigError: no ``_target_``, not ``_partial_``, a bad argument (torch's message is kept),
            or a result that is not a ``torch.optim.Optimizer``.
    """
    if node is None or not node.get("_target_"):
        raise ConfigError("optimizer needs a _target_ (optimizer=sgd|adam|adamw, or optimizer._target_=torch.optim.X).")
    opt = _call(node, "optimizer", params)
    if not isinstance(opt, Optimizer):
        raise ConfigError(f"optimizer._target_={node.get('_target_')!r} built {type(opt).__name__}, not a "
                          "torch.optim.Optimizer.")
    return opt


def build_scheduler(node: Optional[Mapping[str, Any]], optimizer: Optimizer) -> Any:
    """The configured learning-rate scheduler of ``optimizer``, or ``None`` (``_target_: null``).

    Raises:
        ConfigError: not ``_partial_``, a bad argument, or a result without ``step`` and ``state_dict``.
    """
    if node is None or not node.get("_target_"):
        return None
    sched = _call(node, "scheduler", optimizer)
    if not (callable(getattr(sched, "step", None)) and callable(getattr(sched, "state_dict", None))):
        raise ConfigError(f"scheduler._target_={node.get('_target_')!r} built {type(sched).__name__}, which has no "
                          "step() and state_dict().")
    return sched
