"""Residual networks for 32x32 images: ResNet-20 (He et al.'s CIFAR design) and the CIFAR variant of
ResNet-18. GroupNorm by default: see :mod:`robustagg.models.norm` for why BatchNorm's buffers are a
trap in robust training.

References: He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016
(Sec. 4.2 for the CIFAR networks, Sec. 3.3 and Table 1 for ResNet-18).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .norm import make_norm

__all__ = ["BasicBlock", "ResNet", "ResNet20", "ResNet18"]


class BasicBlock(nn.Module):
    """``x -> conv3x3 -> norm -> ReLU -> conv3x3 -> norm (+ shortcut(x)) -> ReLU``.

    Args:
        cin: channels in.
        cout: channels out.
        stride: of the first convolution (2 halves H and W).
        shortcut: when the shape changes, ``"A"`` (He et al. option A: subsample by ``stride`` and
            zero-pad the new channels; no parameters) or ``"B"`` (1x1 convolution + norm).
        norm: see :func:`~robustagg.models.norm.make_norm`.
        num_groups: likewise.
    """

    def __init__(self, cin: int, cout: int, stride: int, *, shortcut: str, norm: str, num_groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(norm, cout, num_groups=num_groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(norm, cout, num_groups=num_groups)
        self.pad = 0
        self.stride = stride
        self.project: nn.Module | None = None
        if stride != 1 or cin != cout:
            if shortcut == "A":
                self.pad = cout - cin
            else:
                self.project = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                             make_norm(norm, cout, num_groups=num_groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        if self.project is not None:
            skip = self.project(x)
        elif self.stride != 1 or self.pad:
            skip = x[:, :, ::self.stride, ::self.stride]
            skip = F.pad(skip, (0, 0, 0, 0, 0, self.pad))  # zero channels appended
        else:
            skip = x
        return F.relu(out + skip)


class ResNet(nn.Module):
    """A stem ``conv3x3(widths[0]) -> norm -> ReLU``, stages of :class:`BasicBlock`, global average
    pooling and a linear classifier; stage ``s > 0`` starts with stride 2.

    Args:
        input_shape: ``(C_in, H, W)`` (inputs may arrive flattened). num_classes: C.
        widths: channels of each stage. blocks: blocks per stage.
        shortcut: ``"A"`` or ``"B"`` (see :class:`BasicBlock`).
        norm: ``group`` (default; no buffers), ``batch`` (running statistics need a buffer rule,
            see :mod:`robustagg.models.norm`) or ``none``. num_groups: G of GroupNorm (default 2,
            our choice: it divides every width and keeps statistics over many channels).

    Shape: ``(b, C_in, H, W)`` or ``(b, C_in*H*W)`` -> ``(b, num_classes)`` logits.

    Raises:
        ConfigError: ``input_shape`` not ``(C, H, W)``, ``widths`` and ``blocks`` of different
            lengths, an unknown ``shortcut`` or ``norm``, or ``num_groups`` not dividing a width.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, widths: Sequence[int], blocks: Sequence[int],
                 shortcut: str = "A", norm: str = "group", num_groups: int = 2) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"a ResNet needs image data of shape (C, H, W); got {tuple(input_shape)}. "
                              "Use model=mlp for this data set.")
        if len(widths) != len(blocks) or not widths:
            raise ConfigError(f"widths and blocks need one entry per stage; got {list(widths)} and {list(blocks)}.")
        if shortcut not in ("A", "B"):
            raise ConfigError(f"model.shortcut must be 'A' (zero-padding identity) or 'B' (1x1 projection); "
                              f"got {shortcut!r}.")
        self.input_shape = tuple(int(v) for v in input_shape)
        self.norm = norm
        c = int(widths[0])
        self.stem = nn.Sequential(nn.Conv2d(self.input_shape[0], c, 3, padding=1, bias=False),
                                  make_norm(norm, c, num_groups=num_groups), nn.ReLU())
        stages: list[nn.Module] = []
        for s, (w, k) in enumerate(zip(widths, blocks)):
            layer = []
            for b in range(int(k)):
                layer.append(BasicBlock(c, int(w), 2 if (s > 0 and b == 0) else 1, shortcut=shortcut, norm=norm,
                                        num_groups=num_groups))
                c = int(w)
            stages.append(nn.Sequential(*layer))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    #: The image side the architecture was designed for (CIFAR's 32x32; He et al. 2016, Sec. 4.2).
    designed_side = 32

    def setting_notes(self) -> list[str]:
        """What this network runs with but was not designed for: images smaller than
        :attr:`designed_side` (``model=resnet20`` on 8x8 digits trains, on 2x2 maps in its last stage).

        Returns:
            one line per problem (empty when none); the app prints each once before the run.
        """
        _, h, w = self.input_shape
        if min(h, w) >= self.designed_side:
            return []
        k = len(self.stages)
        last = f"{max(1, h // 2 ** (k - 1))}x{max(1, w // 2 ** (k - 1))}"
        side = self.designed_side
        return [f"model {type(self).__name__} is built for {side}x{side} images (its {k} stages see {side}, "
                f"{side // 2}... pixel maps); these inputs are {'x'.join(map(str, self.input_shape))}, so its last "
                f"stage sees {last} maps. Use model=mlp or model=cnn for small images, or a {side}x{side} data set "
                f"(data=cifar10)."]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.input_shape)
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(ResNet):
    """ResNet-20 for CIFAR (He et al. 2016, Sec. 4.2, n = 3): a 3x3 convolution with 16 filters,
    then 3 stages of 3 basic blocks with 16, 32 and 64 filters on 32x32, 16x16 and 8x8 maps,
    identity shortcuts with zero-padding where the width grows (option A), global average pooling,
    a linear classifier. 269,722 parameters for 10 classes (the paper's "0.27M").

    Args:
        input_shape: default ``(3, 32, 32)``. num_classes: C.
        norm: see :class:`ResNet` (GroupNorm by default; the paper used BatchNorm).
        num_groups: see :class:`ResNet`.

    Example:
        >>> m = ResNet20()
        >>> m(torch.zeros(2, 3, 32, 32)).shape, sum(p.numel() for p in m.parameters())
        (torch.Size([2, 10]), 269722)
    """

    def __init__(self, input_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, *, norm: str = "group",
                 num_groups: int = 2) -> None:
        super().__init__(input_shape, num_classes, widths=(16, 32, 64), blocks=(3, 3, 3), shortcut="A", norm=norm,
                         num_groups=num_groups)


class ResNet18(ResNet):
    """ResNet-18, CIFAR variant: the ImageNet network of He et al. 2016 (Table 1: 4 stages of 2
    basic blocks, 64/128/256/512 filters, projection shortcuts, option B) with the 7x7 stride-2
    stem and the max-pool replaced by one 3x3 stride-1 convolution, so 32x32 inputs keep their
    resolution in the first stage. 11,173,962 parameters for 10 classes.

    Args:
        input_shape: default ``(3, 32, 32)``. num_classes: C. norm, num_groups: see :class:`ResNet`.

    Note:
        The CIFAR stem is the common adaptation in robust- and federated-learning code, not part of
        the paper, which trained ResNet-18 on ImageNet only.
    """

    def __init__(self, input_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, *, norm: str = "group",
                 num_groups: int = 2) -> None:
        super().__init__(input_shape, num_classes, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), shortcut="B",
                         norm=norm, num_groups=num_groups)
