"""Mixed precision for the workers' gradients: bf16 or fp16 autocast, and fp16's per-worker loss scaler.

``precision`` says in which floating format a worker runs its forward pass and loss:

- ``"32"``: the parameters' own dtype throughout (the default; nothing changes).
- ``"bf16"``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward pass and
  the loss, on CPU and CUDA. bfloat16 has float32's exponent range, so no loss scaling is needed.
- ``"fp16"``: ``torch.autocast(device_type, dtype=torch.float16)`` with a
  :class:`torch.amp.GradScaler` per worker (Micikevicius et al., "Mixed Precision Training",
  ICLR 2018, Sec. 3.2: multiply the loss by a scale ``S`` before the backward pass so small
  gradients do not flush to zero in float16, divide the gradients by ``S`` afterwards). Meant for
  CUDA: the experiment app refuses it on CPU before launch (``trainer.precision``); the library
  accepts it on CPU, where torch's CPU autocast runs it slowly, so that its logic is testable
  without a GPU.

**Where the cast is.** The parameters stay float32 (autocast casts copies for the matmuls), so
their ``.grad`` is float32. In :meth:`Trainer._gradient <robustagg.training.Trainer>`, under fp16
the worker's scaler first divides those gradients by ``S`` in place (``GradScaler.unscale_``: a
float32 multiplication by ``1/S``); then the gradients are flattened and cast with
:func:`submission_dtype` (float32 under bf16 and fp16), before anything leaves the worker.
Every submission, the integrity checks, the robust rule and the optimizer therefore see unscaled float32 rows: aggregation never runs on float16
values, and never on scaled ones (a rule on scaled rows would mix workers with different ``S``).

**Why the scaler is per worker, not replicated.** ``GradScaler.step`` skips the optimizer step when
the gradients overflowed. In robust training the step is the server's, over n submissions; skipping
it on one worker's overflow would need every rank to agree on an overflow flag, and a Byzantine
worker could claim an overflow every step and so drive every honest worker's scale to 1 (where
small gradients underflow again). Here instead each worker owns a scaler and acts on its own
overflow: when its unscaled gradient is not finite while its loss is, the scaler backs off
(``S <- S * backoff_factor``) and the worker computes the same gradient again, on the same batch
with the same random numbers (:class:`Retry` restores the RNG streams and the model's buffers), up
to :data:`MAX_BACKOFFS` times. A finite gradient counts towards growth (``S <- S * growth_factor``
after ``growth_interval`` finite ones in a row), as in ``GradScaler.update``. The scaler's state
depends only on the worker's own computations, so simulated and multi-process runs agree, a
Byzantine worker cannot touch an honest worker's scale, and the state is checkpointed with the
worker's other state (``Trainer.state_dict()["local"]["workers"][id]["scaler"]``).

The server's root gradient (FLTrust's trusted update) and evaluation run in full precision.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["Precision", "parse_precision", "autocast", "new_scaler", "submission_dtype", "Retry", "MAX_BACKOFFS"]

#: How often one worker's fp16 gradient is recomputed with a backed-off scale in one step before
#: the non-finite gradient is submitted as it is (the integrity layer then aborts or drops it).
#: From the default initial scale 2**16 and a backoff of 0.5, 24 backoffs reach 2**-8.
MAX_BACKOFFS = 24


class Precision(str, enum.Enum):
    """The worker's compute precision: ``"32"`` (as the parameters), ``"bf16"`` or ``"fp16"`` autocast."""

    full = "32"
    bf16 = "bf16"
    fp16 = "fp16"


def parse_precision(value: Any, *, device: Optional[torch.device] = None, allow_cpu_fp16: bool = True) -> Precision:
    """``value`` as a :class:`Precision` (``32``, ``"32"``, ``"fp32"``, ``"bf16"``, ``"fp16"``).

    Args:
        value: the setting (``trainer.precision``).
        device: where the workers compute (checked against ``fp16`` when ``allow_cpu_fp16`` is false).
        allow_cpu_fp16: accept ``fp16`` on a CPU device (the library does, for tests; the app does not).

    Raises:
        ConfigError: an unknown value, or ``fp16`` on CPU when not allowed; the message names
            ``trainer.precision`` and the fix.
    """
    text = str(getattr(value, "value", value)).strip().lower()
    text = {"fp32": "32", "float32": "32", "32-true": "32", "bfloat16": "bf16", "float16": "fp16", "16": "fp16"}.get(
        text, text)
    try:
        p = Precision(text)
    except ValueError:
        raise ConfigError(f"trainer.precision must be 32, bf16 or fp16; got {value!r}. Use trainer.precision=bf16 "
                          "for bfloat16 autocast (CPU or CUDA) or trainer.precision=fp16 on CUDA.") from None
    if p is Precision.fp16 and not allow_cpu_fp16 and (device is None or device.type != "cuda"):
        raise ConfigError("trainer.precision=fp16 needs CUDA (float16 autocast with a loss scaler); the workers run "
                          "on the CPU here. Use trainer.precision=bf16 (bfloat16 autocast works on CPU) or "
                          "trainer.precision=32, or trainer.device=cuda on a machine with a GPU.")
    return p


def autocast(precision: Precision, device: torch.device) -> ContextManager[Any]:
    """The context a worker's forward pass and loss run in (``nullcontext`` for ``"32"``)."""
    if precision is Precision.full:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision is Precision.bf16 else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def submission_dtype(precision: Precision, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a worker's submission: the parameters' dtype at ``"32"``, float32 under autocast."""
    return param_dtype if precision is Precision.full else torch.float32


def new_scaler(precision: Precision, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """A fresh :class:`torch.amp.GradScaler` for one worker under ``fp16`` (torch's defaults:
    initial scale 2**16, growth 2 every 2000 finite steps, backoff 0.5), else ``None``."""
    if precision is not Precision.fp16:
        return None
    return torch.amp.GradScaler(device.type)


class Retry:
    """What a worker's recomputation must reset: the torch RNG streams (CPU, and the CUDA device's
    when the model is there) and the model's buffers (e.g. BatchNorm running statistics).

    Args:
        model: the model whose buffers are saved.
        device: where the model is.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        """Put the RNG streams and buffers back to their state at construction."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
