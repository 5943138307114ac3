"""Models for robust training: any ``nn.Module`` works; these are the shipped ones.

- :class:`MLP`, :class:`SmallCNN`: the small models of the bundled data (no normalisation).
- :class:`LeNet5` (LeCun et al. 1998) for 28x28 and 32x32 images.
- :class:`ResNet20` (He et al. 2016, CIFAR, 0.27M parameters) and :class:`ResNet18` (CIFAR variant).

Every model accepts its inputs as images ``(b, C, H, W)`` or flattened ``(b, C*H*W)``.

The shipped ResNets use GroupNorm by default, because BatchNorm's running statistics are buffers
that every worker updates differently while the robust rule aggregates gradients only; see
:mod:`robustagg.models.norm` for the rule and what ``norm="batch"`` then requires.
"""

from .lenet import LeNet5
from .norm import buffer_vector, has_running_stats, load_buffer_vector, make_norm
from .resnet import BasicBlock, ResNet, ResNet18, ResNet20
from .simple import MLP, SmallCNN

__all__ = ["MLP", "SmallCNN", "LeNet5", "ResNet", "ResNet20", "ResNet18", "BasicBlock", "make_norm",
           "has_running_stats", "buffer_vector", "load_buffer_vector"]
