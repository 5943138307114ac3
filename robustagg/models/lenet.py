"""LeNet-5 (LeCun, Bottou, Bengio, Haffner, "Gradient-Based Learning Applied to Document
Recognition", Proc. IEEE 1998), for ``1x28x28`` (MNIST-like) and ``3x32x32`` (CIFAR) images."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["LeNet5"]


class LeNet5(nn.Module):
    """``C1 conv5x5(6) -> S2 pool2 -> C3 conv5x5(16) -> S4 pool2 -> C5 (400->120) -> F6 (120->84) -> C``.

    The paper's network reads 32x32 images; a 28x28 input is zero-padded by 2 pixels in C1
    (the paper likewise placed the 28x28 digits in a 32x32 field), so both input sizes reach C5
    with 16 maps of 5x5.

    Args:
        input_shape: ``(C_in, H, W)``, either ``(1, 28, 28)``/``(C, 28, 28)`` or ``(C, 32, 32)``.
        num_classes: C. activation: ``relu`` (default) or ``tanh``. pool: ``max`` (default) or ``avg``.

    Shape: ``(b, C_in, H, W)`` or flattened ``(b, C_in*H*W)`` -> ``(b, num_classes)`` logits.

    Parameters: ``6(25 C_in + 1) + 16(150 + 1) + 120(400 + 1) + 84(120 + 1) + C(84 + 1)``;
    61,706 for ``(1, 28, 28)`` and 62,006 for ``(3, 32, 32)`` with 10 classes.

    Raises:
        ConfigError: another image size, or an unknown activation or pool.

    Note:
        Deviates from the paper the way common modern versions do: C3 connects every S2 map
        (the paper used a sparse connection table, 1,516 instead of 2,416 C3 parameters),
        S2/S4 are parameter-free pools instead of trainable subsampling, ReLU and max-pooling
        by default instead of the scaled tanh, and a linear output layer instead of RBF units.

    Example:
        >>> LeNet5((1, 28, 28), 10)(torch.zeros(2, 784)).shape
        torch.Size([2, 10])
    """

    def __init__(self, input_shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, *,
                 activation: str = "relu", pool: str = "max") -> None:
        super().__init__()
        if len(input_shape) != 3 or tuple(input_shape[1:]) not in ((28, 28), (32, 32)):
            raise ConfigError(f"model=lenet5 needs images of shape (C, 28, 28) or (C, 32, 32); got "
                              f"{tuple(input_shape)}.")
        acts = {"relu": nn.ReLU, "tanh": nn.Tanh}
        pools = {"max": nn.MaxPool2d, "avg": nn.AvgPool2d}
        if activation not in acts or pool not in pools:
            raise ConfigError(f"model.activation must be one of {sorted(acts)} and model.pool one of {sorted(pools)}; "
                              f"got {activation!r}, {pool!r}.")
        c, h, _ = (int(v) for v in input_shape)
        self.input_shape = (c, h, h)
        act, pl = acts[activation], pools[pool]
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=2 if h == 28 else 0), act(), pl(2),  # C1, S2: 28x28 -> 14x14
            nn.Conv2d(6, 16, 5), act(), pl(2),  # C3, S4: 10x10 -> 5x5
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120), act(),  # C5 (a 5x5 convolution over a 5x5 map is a linear layer)
            nn.Linear(120, 84), act(),  # F6
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.input_shape)
        return self.classifier(self.features(x).flatten(1))
