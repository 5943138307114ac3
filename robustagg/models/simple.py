"""The small models of the bundled data: an MLP (optional dropout) and a CNN.

No normalisation layers: no per-batch running state, so a worker's gradient depends only on the
parameters, its batch and its own RNG stream.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["MLP", "SmallCNN"]


class MLP(nn.Module):
    """Fully connected network ``D -> hidden[0] -> ... -> C`` with ReLU between layers.

    Args:
        in_features: D (flattened input size). hidden: widths of the hidden layers (may be empty:
            a linear model). num_classes: C.
        dropout: dropout probability after each hidden layer (0 = none). Its masks come from the
            worker's own RNG stream (see :class:`robustagg.training.Trainer`), so runs stay
            reproducible and mode-independent on CPU.

    Shape: ``(b, D)`` (or ``(b, *input_shape)``, flattened) -> ``(b, C)`` logits.

    Example:
        >>> import torch
        >>> MLP(64, [32], 10)(torch.zeros(5, 64)).shape
        torch.Size([5, 10])
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1); got {dropout}.")
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], -1))


class SmallCNN(nn.Module):
    """``[conv3x3 (padding 1) -> ReLU -> maxpool 2] x len(channels)`` then a linear classifier.

    Args:
        image_shape: ``(C_in, H, W)`` of one example (inputs may arrive flattened).
        channels: output channels of each conv block. num_classes: C.

    Shape: ``(b, C_in*H*W)`` or ``(b, C_in, H, W)`` -> ``(b, C)`` logits.

    Raises:
        ConfigError: ``image_shape`` is not ``(C, H, W)``, or too many blocks for the image size
            (each halves H and W).

    Example:
        >>> import torch
        >>> SmallCNN((1, 8, 8), [8, 16], 10)(torch.zeros(3, 64)).shape
        torch.Size([3, 10])
    """

    def __init__(self, image_shape: Sequence[int], channels: Sequence[int], num_classes: int) -> None:
        super().__init__()
        if len(image_shape) != 3:
            raise ConfigError(f"model=cnn needs image data with shape (C, H, W); got {tuple(image_shape)}. "
                              "Use model=mlp for this data set.")
        c, h, w = (int(v) for v in image_shape)
        if min(h, w) < 2 ** len(channels):
            raise ConfigError(f"model.channels has {len(channels)} blocks, each halving the {h}x{w} image; "
                              f"use at most {max(0, min(h, w).bit_length() - 1)}.")
        self.image_shape = (c, h, w)
        blocks: list[nn.Module] = []
        for out in channels:
            blocks += [nn.Conv2d(c, int(out), 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c, h, w = int(out), h // 2, w // 2
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        return self.head(self.features(x).flatten(1))
