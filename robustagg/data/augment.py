"""Per-worker data augmentation drawn from the worker's own RNG stream: random crop + horizontal flip.

The standard CIFAR augmentation (He, Zhang, Ren, Sun, "Deep Residual Learning for Image
Recognition", CVPR 2016, Sec. 4.2: "4 pixels are padded on each side, and a 32x32 crop is randomly
sampled from the padded image or its horizontal flip"), on a batch of tensors, vectorised, with
every random number taken from one ``torch.Generator``.

Reproducibility: :func:`random_crop_flip` with ``generator=None`` draws from torch's default CPU
generator. The trainer swaps each worker's own stream into that generator around the worker's
forward pass (:class:`robustagg.training.Trainer`, as for dropout) and checkpoints it, so
:class:`Augment` placed in front of the model draws the same crops in an uninterrupted and in a
restored run, and whichever process hosts the worker.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ShapeError

__all__ = ["random_crop_flip", "Augment", "DEFAULT_AUGMENT"]

#: Whether each data set is augmented by default: on for CIFAR, off for MNIST-like digits and clothes.
DEFAULT_AUGMENT = {"mnist": False, "fashion_mnist": False, "cifar10": True, "cifar100": True}


def random_crop_flip(x: torch.Tensor, generator: Optional[torch.Generator] = None, *, padding: int = 4,
                     flip: bool = True, fill: float = 0.0) -> torch.Tensor:
    """Pad each image by ``padding`` pixels of value ``fill``, crop a random ``H x W`` window, and
    mirror it left-right with probability 1/2.

    Definition: for example ``b``, offsets ``dy_b, dx_b`` are uniform in ``{0, ..., 2 * padding}``
    and ``out[b, :, i, j] = pad(x)[b, :, dy_b + i, dx_b + j']`` with ``j' = W - 1 - j`` if example
    ``b`` is flipped, else ``j' = j``. Random numbers, in this order: ``dy`` (B values), ``dx``
    (B values), then the flips (B values), all from ``generator``.

    Args:
        x: ``(B, C, H, W)`` floating tensor (not modified).
        generator: the source of randomness (``None``: torch's default generator, see the module note).
        padding: pixels added on each side (>= 0; 0 disables the crop).
        flip: also mirror with probability 1/2.
        fill: the value of the padded pixels (0 is black on ``[0, 1]`` images).

    Returns:
        A new ``(B, C, H, W)`` tensor, same dtype and device.

    Raises:
        ShapeError: ``x`` is not 4-d floating.
        ConfigError: ``padding`` negative.

    Example:
        >>> x = torch.arange(4.0).reshape(1, 1, 2, 2)
        >>> random_crop_flip(x, torch.Generator().manual_seed(0), padding=0).shape
        torch.Size([1, 1, 2, 2])
    """
    if x.ndim != 4 or not x.is_floating_point():
        raise ShapeError(f"random_crop_flip needs a (B, C, H, W) floating tensor; got {x.dtype} of shape "
                         f"{tuple(x.shape)}.")
    if padding < 0:
        raise ConfigError(f"padding must be >= 0; got {padding}.")
    b, c, h, w = x.shape
    dev = x.device
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device=gen_dev).to(dev)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device=gen_dev).to(dev)
    cols = torch.arange(w, device=dev).expand(b, w)
    if flip:
        mirrored = torch.rand(b, generator=generator, device=gen_dev).to(dev) < 0.5
        cols = torch.where(mirrored[:, None], (w - 1) - cols, cols)
    padded = F.pad(x, (padding, padding, padding, padding), value=fill) if padding else x
    rows = dy[:, None] + torch.arange(h, device=dev)  # (B, H)
    cols = dx[:, None] + cols  # (B, W)
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return padded[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


class Augment(nn.Module):
    """:func:`random_crop_flip` as a module: active in training mode, the identity in eval mode.

    Put it in front of a model (``nn.Sequential(Augment((3, 32, 32)), model)``): it has no
    parameters or buffers, so submissions and checkpoints do not change, and it draws from the
    default generator, which the trainer sets to each worker's checkpointed stream.

    Args:
        image_shape: ``(C, H, W)``; inputs may arrive flattened ``(B, C*H*W)`` and leave in the
            shape they came in. padding, flip, fill: see :func:`random_crop_flip`.

    Raises:
        ConfigError: ``image_shape`` not ``(C, H, W)``, or ``padding`` negative.
    """

    def __init__(self, image_shape: Sequence[int], *, padding: int = 4, flip: bool = True, fill: float = 0.0) -> None:
        super().__init__()
        if len(image_shape) != 3:
            raise ConfigError(f"augmentation needs image data of shape (C, H, W); got {tuple(image_shape)}.")
        if padding < 0:
            raise ConfigError(f"padding must be >= 0; got {padding}.")
        self.image_shape = tuple(int(s) for s in image_shape)
        self.padding, self.flip, self.fill = int(padding), bool(flip), float(fill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        out = random_crop_flip(x.reshape(x.shape[0], *self.image_shape), padding=self.padding, flip=self.flip,
                               fill=self.fill)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"image_shape={self.image_shape}, padding={self.padding}, flip={self.flip}"
