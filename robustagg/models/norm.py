"""Normalisation layers for the shipped models, and the BatchNorm trap in robust training.

**The rule: GroupNorm by default.** A robust rule aggregates *gradients*; every rank applies the
same aggregate, so parameters stay bitwise equal. BatchNorm's running mean and variance (Ioffe,
Szegedy, ICML 2015) are *buffers*, not gradients: each worker updates them from its own batches
during its forward pass, so after one step every worker (and every process, which may host
several simulated workers running their forward passes on one model) holds different statistics,
the evaluated model depends on who evaluates it, and a Byzantine worker's batches enter the
statistics with no rule in the way. GroupNorm (Wu, He, ECCV 2018) normalises each example over
groups of channels with no running state, so it has no buffers; Hsieh, Phanishayee, Mutlu,
Gibbons (ICML 2020) replace BatchNorm by GroupNorm in decentralised training for the same reason.

``norm="batch"`` remains available for comparison, and then needs a buffer rule that the
trainer does not apply by itself: aggregate the buffers as a submission of their own by the same
robust rule every step (:func:`buffer_vector`, :func:`load_buffer_vector`), or keep them per
worker and evaluate with one agreed copy. :func:`has_running_stats` lets a caller refuse or warn.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..errors import ConfigError, ShapeError

__all__ = ["Norm", "make_norm", "has_running_stats", "buffer_vector", "load_buffer_vector"]

Norm = Literal["group", "batch", "none"]


def make_norm(norm: str, channels: int, *, num_groups: int = 2) -> nn.Module:
    """A normalisation layer over ``channels`` feature maps.

    Args:
        norm: ``group`` (``nn.GroupNorm(num_groups, channels)``, no buffers; the default of the
            shipped ResNets), ``batch`` (``nn.BatchNorm2d``, running statistics as buffers: see the
            module note) or ``none`` (identity).
        channels: C. num_groups: G for ``group``; must divide C.

    Raises:
        ConfigError: unknown ``norm``, or ``num_groups`` not a divisor of ``channels``.

    Example:
        >>> gn = make_norm("group", 16)
        >>> type(gn).__name__, gn.num_groups, len(list(gn.buffers())), len(list(make_norm("batch", 16).buffers()))
        ('GroupNorm', 2, 0, 3)
    """
    if norm == "group":
        if num_groups < 1 or channels % num_groups:
            raise ConfigError(f"model.num_groups={num_groups} must divide every layer's channels; {channels} "
                              "does not divide. Use a divisor of the smallest width (e.g. 1, 2, 4, 8 or 16).")
        return nn.GroupNorm(num_groups, channels)
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "none":
        return nn.Identity()
    raise ConfigError(f"model.norm must be 'group', 'batch' or 'none'; got {norm!r}.")


def has_running_stats(model: nn.Module) -> bool:
    """True if any layer of ``model`` keeps running statistics (BatchNorm and friends with
    ``track_running_stats``): then replicas drift apart unless a buffer rule is applied."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules())


def buffer_vector(model: nn.Module) -> torch.Tensor:
    """The model's floating-point buffers (running means and variances) flattened into one ``(k,)``
    vector, in ``model.buffers()`` order: a submission a robust rule can aggregate.

    Integer buffers (``num_batches_tracked``) are left out: they count forward passes, not data.

    Example:
        >>> bn = nn.BatchNorm2d(2)
        >>> buffer_vector(bn).tolist()  # running_mean (zeros), running_var (ones)
        [0.0, 0.0, 1.0, 1.0]
    """
    bufs = [b.detach().reshape(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat(bufs) if bufs else torch.zeros(0)


def load_buffer_vector(model: nn.Module, vec: torch.Tensor) -> None:
    """Write ``vec`` (a :func:`buffer_vector` of the same architecture, e.g. the robust aggregate of
    every worker's) back into the model's floating-point buffers, in place.

    Raises:
        ShapeError: ``vec`` is not 1-d of the model's buffer length.
    """
    bufs = [b for b in model.buffers() if b.is_floating_point()]
    total = sum(b.numel() for b in bufs)
    if vec.ndim != 1 or vec.numel() != total:
        raise ShapeError(f"buffer vector must have shape ({total},) for this model; got {tuple(vec.shape)}.")
    offset = 0
    with torch.no_grad():
        for b in bufs:
            b.copy_(vec[offset:offset + b.numel()].view_as(b))
            offset += b.numel()
