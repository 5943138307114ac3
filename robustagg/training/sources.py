"""Per-worker batch sources with a restorable position: any iterable or DataLoader, not only tensors.

The trainer draws a worker's batches from a :class:`BatchSource`: ``next_batch()`` and an explicit
``state_dict`` (the position) that committed checkpoints save and restore. In-memory tensors
(:class:`~robustagg.training.Shard`) get the trainer's :class:`~robustagg.training.ShardSampler`;
anything else iterable is wrapped in :class:`IterableSource`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, runtime_checkable

from ..errors import ConfigError

__all__ = ["BatchSource", "IterableSource"]


@runtime_checkable
class BatchSource(Protocol):
    """A worker's batches: ``next_batch() -> batch``, with ``state_dict()`` / ``load_state_dict(state)``.

    The batch is handed to the trainer's loss as it is (``(x, y)`` tuples also get a data attack's
    label poison). A restored source must yield exactly the batches the uninterrupted run would.
    """

    def next_batch(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Same:
    """``epoch -> iterable`` that returns the same re-iterable object every epoch (picklable)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __call__(self, epoch: int) -> Iterable[Any]:
        return self.iterable  # type: ignore[no-any-return]


class IterableSource:
    """Batches from ``make_epoch(epoch)`` (an iterable per epoch, e.g. a DataLoader), position = (epoch, batches).

    Restore re-creates epoch ``e``'s iterable and skips the batches already consumed, so the
    iterable must be deterministic per epoch: a DataLoader whose sampler is seeded from the epoch
    (``torch.Generator().manual_seed(seed + epoch)`` or ``DistributedSampler.set_epoch``), or a
    fixed list. Skipping costs the time of drawing those batches once.

    Args:
        make_epoch: ``epoch -> Iterable[batch]``; or pass ``iterable`` for the same one every epoch.
        iterable: a re-iterable object (list, DataLoader) used for every epoch.

    Raises:
        ConfigError: neither or both given; an epoch yields no batch.

    Example:
        >>> src = IterableSource(iterable=[1, 2, 3])
        >>> [src.next_batch() for _ in range(4)], src.state_dict()
        ([1, 2, 3, 1], {'epoch': 1, 'position': 1})
        >>> again = IterableSource(iterable=[1, 2, 3]); again.load_state_dict({'epoch': 1, 'position': 1})
        >>> again.next_batch()
        2
    """

    def __init__(self, make_epoch: Optional[Callable[[int], Iterable[Any]]] = None, *,
                 iterable: Optional[Iterable[Any]] = None) -> None:
        if (make_epoch is None) == (iterable is None):
            raise ConfigError("IterableSource needs exactly one of make_epoch (epoch -> iterable) or iterable.")
        self._make: Callable[[int], Iterable[Any]] = make_epoch if make_epoch is not None else _Same(iterable)
        self.epoch = 0
        self.position = 0
        self._it: Optional[Iterator[Any]] = None

    def _open(self) -> Iterator[Any]:
        it = iter(self._make(self.epoch))
        for _ in range(self.position):
            next(it)
        return it

    def next_batch(self) -> Any:
        """The next batch (a new epoch starts when the current one is exhausted)."""
        if self._it is None:
            self._it = self._open()
        try:
            batch = next(self._it)
        except StopIteration:
            if self.position == 0:
                raise ConfigError(f"the batch source yielded no batch in epoch {self.epoch}.") from None
            self.epoch, self.position = self.epoch + 1, 0
            self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:
                raise ConfigError(f"the batch source yielded no batch in epoch {self.epoch}.") from None
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": e, "position": batches consumed in epoch e}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the next batch is the one after that position)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._it = None
