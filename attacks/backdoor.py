"""Backdoor attacks: a pixel-pattern trigger with a target label (BadNets), split (DBA), boosted (model replacement).

The Byzantine workers stamp a trigger on a fraction of the images of their batch and relabel those
to the target class, then compute their gradient honestly on the poisoned batch (``kind = data``).
The trigger is a ``size x size`` square of pixels set to ``value`` (every channel) whose
bottom-right corner lies ``margin`` pixels from the image's bottom-right corner. The attack's
success is measured on the test images whose true label is not the target, stamped with the full
trigger: the fraction classified as the target (``test/asr``, see
:func:`robustagg.training.evaluate`, which takes :meth:`Backdoor.stamp` and :attr:`Backdoor.target`).

How the trainer applies them: :meth:`Backdoor.poison_batch` is the Byzantine worker's batch hook
(``ByzantineBehaviour.batch_poison_fn``: ``(x, y, num_classes, index) -> (x, y)``, ``index`` the
worker's position among the Byzantine ranks). ``attack(honest, f, own=own)`` then returns ``own``
unchanged (BadNets, DBA) or boosted (model replacement): the same gradient hook serves all three.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

from robustagg.errors import ConfigError, ShapeError

from .base import Attack, Kind, Knowledge, finite_float, positive_float
from .registry import register

__all__ = ["Backdoor", "BackdoorDBA", "ModelReplacement"]


def _int(value: object, name: str, attack: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{attack}: {name} must be an integer >= {lo}; got {value!r}.")
    return value


@register("backdoor")
class Backdoor(Attack):
    r"""BadNets backdoor: a pixel-square trigger stamped on a fraction of the batch, relabelled to the target.

    Definition: for a Byzantine worker's batch ``(x, y)`` of ``B`` examples, the first
    ``m = ceil(fraction * B)`` examples (the sampler shuffles, so across steps a uniform subset) get
    the trigger stamped (:meth:`stamp`: the ``size x size`` square whose bottom-right corner is
    ``margin`` pixels from the image's, set to ``value`` in every channel) and the label ``target``;
    the other ``B - m`` examples are unchanged. The worker then trains honestly on the poisoned
    batch, and its gradient is submitted unchanged (``attack(honest, f, own=own)`` returns a copy of
    ``own``).

    Images: ``x`` is ``(B, C, H, W)``, ``(B, H, W)`` or flat ``(B, D)``; flat inputs are read as
    ``image_shape`` (``(C, H, W)`` or ``(H, W)``), or, when ``image_shape`` is ``None``, as one
    ``sqrt(D) x sqrt(D)`` channel (``D`` must then be a perfect square, e.g. 64 for the 8x8
    digits).

    Knowledge: ``own`` (its own data; nothing about the honest workers).

    Args:
        target: the target class ``>= 0`` (checked against ``num_classes`` when poisoning), default 0.
        fraction: fraction of each batch poisoned, in ``(0, 1]``, default 0.5.
        size: side of the trigger square in pixels ``>= 1``, default 3.
        margin: distance of the square from the bottom-right corner ``>= 0``, default 0.
        value: the stamped pixel value (finite), default 1.0 (white for inputs in ``[0, 1]``; set it
            to the normalised white for normalised inputs).
        image_shape: ``None`` or the per-example ``(C, H, W)`` / ``(H, W)`` of flat inputs.

    Shape: :meth:`poison_batch` ``x (B, ...), y (B,) -> same shapes and dtypes`` (new tensors);
    ``__call__`` ``own (f, d) -> (f, d)``.

    Raises:
        ConfigError: a parameter out of range; ``own`` missing in ``__call__``; ``target >=
            num_classes``.
        ShapeError: ``x`` not floating or not matching ``y``; the image shape cannot be inferred, or
            the trigger does not fit in the image.

    Example:
        >>> import torch, attacks
        >>> a = attacks.Backdoor(target=7, fraction=0.5, size=2)
        >>> x, y = torch.zeros(2, 16), torch.tensor([1, 2])   # two flat 4x4 images
        >>> xp, yp = a.poison_batch(x, y, 10)
        >>> yp.tolist(), xp[0].reshape(4, 4)[2:, 2:].tolist(), float(xp[1].sum())
        ([7, 2], [[1.0, 1.0], [1.0, 1.0]], 0.0)

    References:
        Gu, Dolan-Gavitt, Garg, "BadNets: identifying vulnerabilities in the machine learning model
        supply chain", arXiv:1708.06733, 2017.
    """

    knowledge = Knowledge.OWN
    kind = Kind.DATA
    paper = "Gu, Dolan-Gavitt, Garg, 2017"

    def __init__(self, *, target: int = 0, fraction: float = 0.5, size: int = 3, margin: int = 0,
                 value: float = 1.0, image_shape: Optional[Sequence[int]] = None) -> None:
        who = type(self).__name__
        self.target = _int(target, "target", who, 0)
        self.fraction = positive_float(fraction, "fraction", who)
        if self.fraction > 1.0:
            raise ConfigError(f"{who}: fraction must be in (0, 1]; got {fraction!r}.")
        self.size = _int(size, "size", who, 1)
        self.margin = _int(margin, "margin", who, 0)
        self.value = finite_float(value, "value", who)
        if image_shape is not None:
            shape = tuple(image_shape)
            if len(shape) not in (2, 3) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
                raise ConfigError(f"{who}: image_shape must be None or (C, H, W) / (H, W) positive ints; got "
                                  f"{image_shape!r}.")
            image_shape = shape if len(shape) == 3 else (1, *shape)
        self.image_shape: Optional[tuple[int, ...]] = None if image_shape is None else tuple(image_shape)

    # --- the trigger ---------------------------------------------------------------------------
    def _rows(self, part: Optional[int]) -> list[int]:
        """Rows of the square (0-based, within the square) that ``part`` stamps; all for ``None``."""
        return list(range(self.size))

    def _images(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` viewed as ``(B, C, H, W)``."""
        b = x.shape[0]
        if self.image_shape is not None:
            if math.prod(x.shape[1:]) != math.prod(self.image_shape):
                raise ShapeError(f"{type(self).__name__}: x has {math.prod(x.shape[1:])} values per example but "
                                 f"image_shape={self.image_shape} has {math.prod(self.image_shape)}.")
            return x.reshape(b, *self.image_shape)
        if x.dim() == 4:
            return x
        if x.dim() == 3:
            return x.unsqueeze(1)
        if x.dim() == 2:
            side = math.isqrt(x.shape[1])
            if side * side != x.shape[1]:
                raise ShapeError(f"{type(self).__name__}: cannot read {x.shape[1]} flat values as a square image; "
                                 "pass image_shape=(C, H, W).")
            return x.reshape(b, 1, side, side)
        raise ShapeError(f"{type(self).__name__}: x must be (B, C, H, W), (B, H, W) or (B, D); got "
                         f"{tuple(x.shape)}.")

    def stamp(self, x: torch.Tensor, part: Optional[int] = None) -> torch.Tensor:
        """``x`` with the trigger (``part`` of it, for DBA; the full trigger for ``None``) stamped on every example.

        Args:
            x: floating inputs ``(B, C, H, W)``, ``(B, H, W)`` or ``(B, D)`` (see the class docstring).
            part: ``None`` (full trigger) or the part index (:class:`BackdoorDBA`).

        Returns:
            a new tensor, the shape, dtype and device of ``x``.

        Raises:
            ShapeError: ``x`` not floating, the image shape cannot be read, or the trigger does not fit.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
            raise ShapeError(f"{type(self).__name__}: x must be a floating tensor (B, ...); got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}.")
        out = x.clone()
        img = self._images(out)
        h, w = img.shape[-2:]
        if self.size + self.margin > min(h, w):
            raise ShapeError(f"{type(self).__name__}: a trigger of size {self.size} at margin {self.margin} does not "
                             f"fit in {h}x{w} images; lower size or margin.")
        top, left = h - self.margin - self.size, w - self.margin - self.size
        for r in self._rows(part):
            img[:, :, top + r, left:left + self.size] = self.value
        return out  # img is a view of out

    def poison_batch(self, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                     index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Stamp the trigger on the first ``ceil(fraction * B)`` examples and relabel them to ``target``.

        Args:
            x: floating inputs ``(B, ...)``; y: integer labels ``(B,)``.
            num_classes: ``C`` (the target must be below it).
            index: the worker's position among the Byzantine workers (selects the DBA part).

        Returns:
            ``(x', y')``, new tensors with the shapes and dtypes of ``x`` and ``y``.

        Raises:
            ConfigError: ``target >= num_classes``, or ``index`` not an integer ``>= 0``.
            ShapeError: see :meth:`stamp`; ``y`` not an integer ``(B,)`` tensor.
        """
        who = type(self).__name__
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or self.target >= num_classes:
            raise ConfigError(f"{who}: target={self.target} must be below num_classes={num_classes!r}.")
        _int(index, "index", who, 0)
        if (not isinstance(y, torch.Tensor) or y.is_floating_point() or y.dtype == torch.bool or y.dim() != 1
                or not isinstance(x, torch.Tensor) or x.shape[0] != y.shape[0]):
            raise ShapeError(f"{who}: y must be integer labels (B,) matching x (B, ...); got "
                             f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} for x "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}.")
        m = math.ceil(self.fraction * y.shape[0])
        xp, yp = x.clone(), y.clone()
        if m:
            xp[:m] = self.stamp(x[:m], self._part(index))
            yp[:m] = self.target
        return xp, yp

    def _part(self, index: int) -> Optional[int]:
        """The trigger part worker ``index`` stamps: the full trigger (``None``) for BadNets."""
        return None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert own is not None
        return own.clone()

    def _params(self) -> dict[str, Any]:
        return {"target": self.target, "fraction": self.fraction, "size": self.size, "margin": self.margin,
                "value": self.value, "image_shape": self.image_shape}


@register("backdoor_dba")
class BackdoorDBA(Backdoor):
    r"""Distributed backdoor attack (DBA): the trigger split into ``parts`` pieces, one per Byzantine worker.

    Definition: the full trigger is :class:`Backdoor`'s ``size x size`` square; its rows are split
    into ``parts`` contiguous groups (``torch.tensor_split`` of ``range(size)``: the first
    ``size mod parts`` groups have one row more), so each part is a bar of one or more rows. The
    Byzantine worker at position ``i`` among the Byzantine ranks stamps part ``i mod parts`` on its
    poisoned examples (and relabels them to ``target``); nobody trains on the full trigger.
    Evaluation (``test/asr``) uses the **full** trigger (:meth:`stamp` with ``part=None``).

    Knowledge: ``own``.

    Args:
        parts: number of trigger parts, ``1 <= parts <= size``, default 3; the others as
            :class:`Backdoor`.

    Shape, Raises: as :class:`Backdoor`; also ConfigError for ``parts`` out of range.

    Example:
        >>> import torch, attacks
        >>> a = attacks.BackdoorDBA(size=2, parts=2, fraction=1.0)
        >>> x, y = torch.zeros(1, 16), torch.tensor([3])
        >>> [a.poison_batch(x, y, 10, index=i)[0].reshape(4, 4)[2:, 2:].tolist() for i in (0, 1)]
        [[[1.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [1.0, 1.0]]]

    References:
        Xie, Huang, Chen, Li, "DBA: distributed backdoor attacks against federated learning",
        ICLR 2020.
    """

    paper = "Xie, Huang, Chen, Li, ICLR 2020"

    def __init__(self, *, target: int = 0, fraction: float = 0.5, size: int = 3, margin: int = 0,
                 value: float = 1.0, image_shape: Optional[Sequence[int]] = None, parts: int = 3) -> None:
        super().__init__(target=target, fraction=fraction, size=size, margin=margin, value=value,
                         image_shape=image_shape)
        self.parts = _int(parts, "parts", "BackdoorDBA", 1)
        if self.parts > self.size:
            raise ConfigError(f"BackdoorDBA: parts={parts} must be <= size={self.size} (one trigger row at least "
                              "per part).")

    def _rows(self, part: Optional[int]) -> list[int]:
        if part is None:
            return list(range(self.size))
        return [int(r) for r in torch.tensor_split(torch.arange(self.size), self.parts)[part % self.parts]]

    def _part(self, index: int) -> Optional[int]:
        return index % self.parts

    def _params(self) -> dict[str, Any]:
        return {**super()._params(), "parts": self.parts}


@register("model_replacement")
class ModelReplacement(Backdoor):
    r"""Model replacement: the BadNets backdoor with the Byzantine gradient boosted so that it survives averaging.

    Definition: the batch is poisoned as in :class:`Backdoor`; the Byzantine worker's own gradient
    ``g_k`` on it (``own[k]``) is submitted as ``boost * g_k``. The paper scales the attacker's
    model difference by ``gamma = n / eta`` (``eta`` the server learning rate of FedAvg's
    ``G + eta/n * sum_i (L_i - G)``) so that the new global model is the attacker's. Here the
    aggregate is the gradient the optimizer applies (``eta = 1``) and ``f`` attackers share the
    boost, so the default is ``boost = n / f`` with ``n = h + f``: against the mean, ``f`` rows
    ``(n/f) g`` contribute ``g`` to the aggregate, as if the honest workers' gradients cancelled
    (the paper's assumption near convergence).

    Knowledge: ``own`` (its own data and gradient; ``n`` from the shape of ``honest`` only).

    Args:
        boost: ``None`` (default, ``n / f``) or a positive finite factor; the others as
            :class:`Backdoor`.

    Shape, Raises: as :class:`Backdoor`; also ConfigError for ``boost`` not positive.

    Example:
        >>> import torch, attacks
        >>> own = torch.tensor([[1.0, -2.0]])
        >>> attacks.ModelReplacement()(torch.zeros(3, 2), 1, own=own)   # n = 4, f = 1: boost 4
        tensor([[ 4., -8.]])

    References:
        Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How to backdoor federated learning",
        AISTATS 2020.
    """

    paper = "Bagdasaryan et al., AISTATS 2020"

    def __init__(self, *, target: int = 0, fraction: float = 0.5, size: int = 3, margin: int = 0,
                 value: float = 1.0, image_shape: Optional[Sequence[int]] = None,
                 boost: Optional[float] = None) -> None:
        super().__init__(target=target, fraction=fraction, size=size, margin=margin, value=value,
                         image_shape=image_shape)
        self.boost = None if boost is None else positive_float(boost, "boost", "ModelReplacement")
        #: The boost used by the last call.
        self.last_boost: Optional[float] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert own is not None
        boost = (honest.shape[0] + f) / f if self.boost is None else self.boost
        self.last_boost = boost
        return own.to(torch.float64) * boost

    def _params(self) -> dict[str, Any]:
        return {**super()._params(), "boost": self.boost}
