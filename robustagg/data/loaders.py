"""One entry point per source: published files (:func:`load`), your own builder's output
(:func:`from_user`); both return a :class:`LoadedData`. Hugging Face data sets: :mod:`.hf`.

Images are ``(N, C, H, W)`` (``C = 1`` for MNIST and Fashion-MNIST, 3 for CIFAR), float32 in
``[0, 1]`` (pixel / 255) by default, or the files' uint8 with ``as_float=False`` (a quarter of
the memory: CIFAR-10's training set is 150 MiB in uint8, 600 MiB in float32). No normalisation
and no augmentation are applied here (see :mod:`.augment`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError, MissingDataError
from .cifar import load_cifar
from .folders import IDX_FILES, SYSTEM_ROOTS, check_name, find_file, resolve, system_root
from .idx import load_idx_pair

__all__ = ["LoadedData", "load", "from_user", "NUM_CLASSES"]

#: Classes of each file-based data set (CIFAR-100 with fine labels; 20 with ``label="coarse"``).
NUM_CLASSES = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100}


@dataclass
class LoadedData:
    """A data set's train and test split, before any partition among workers.

    Attributes:
        train_x: ``(N, *input_shape)`` float32 (or uint8 images with ``as_float=False``).
        train_y: ``(N,)`` int64 labels in ``[0, num_classes)``.
        test_x, test_y: the held-out split, same layout (``M`` may be 0 when the source has none).
        num_classes: C. input_shape: one example's shape, e.g. ``(3, 32, 32)``.
        name: the data set's name.
        groups: ``(N,)`` int64, the natural group (e.g. the writer of a FEMNIST character) of
            each training example, numbered ``0..G-1`` in the order of ``group_names``; or ``None``.
        group_names: the group keys as the source names them (sorted).
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    name: str = ""
    groups: Optional[torch.Tensor] = None
    group_names: tuple[Any, ...] = ()

    def astuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, tuple[int, ...]]:
        """``(train_x, train_y, test_x, test_y, num_classes, input_shape)``."""
        return self.train_x, self.train_y, self.test_x, self.test_y, self.num_classes, self.input_shape

    def group_indices(self) -> list[np.ndarray]:
        """Per natural group (in ``group_names`` order), the sorted int64 indices of its training
        examples.

        Raises:
            ConfigError: the data set has no natural groups (``groups is None``).
        """
        if self.groups is None:
            raise ConfigError(f"data set {self.name or '?'} has no natural groups; give data.partition_key "
                              "(e.g. writer_id) for data=hf, or use another partition.")
        g = self.groups.numpy()
        order = np.argsort(g, kind="stable")
        cuts = np.searchsorted(g[order], np.arange(1, len(self.group_names)))
        return [np.sort(p).astype(np.int64) for p in np.split(order, cuts)]


def _tensor_images(x: np.ndarray, as_float: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(torch.float32).div_(255.0) if as_float else t


def load(name: str, root: str | Path | None = None, *, download: bool = False, as_float: bool = True,
         label: Literal["fine", "coarse"] = "fine") -> LoadedData:
    """Load ``mnist``, ``fashion_mnist``, ``cifar10`` or ``cifar100`` from its published files under ``root``.

    The files are looked up in ``root`` and the folders other tools use (see
    :mod:`robustagg.data.folders`); with ``download=True`` and nothing found, they are fetched and
    verified first (:func:`robustagg.data.download.download`).

    Args:
        name: the data set. root: the data root; ``None``: the folder an operating-system package
            installed the files in (:func:`~robustagg.data.folders.system_root`: Debian's
            ``dataset-fashion-mnist``, which ``make data`` installs). download: fetch missing files.
        as_float: float32 in ``[0, 1]`` (default) or the files' uint8.
        label: CIFAR-100 only: ``fine`` (100 classes) or ``coarse`` (20).

    Returns:
        A :class:`LoadedData`: MNIST-like sets 60000 / 10000 examples of ``(1, 28, 28)``, CIFAR
        50000 / 10000 of ``(3, 32, 32)``, in file order.

    Raises:
        ConfigError: unknown name or label.
        MissingDataError: files absent (and ``download`` off or impossible); the message says which
            files to place where.
        DataFileError: a file is truncated or corrupt (the message names it and the expected size), or
            an MNIST / Fashion-MNIST file that declares the published dimensions has other content than
            the published file (both digests: :mod:`robustagg.data.digests`).
    """
    check_name(name)
    if label not in ("fine", "coarse"):
        raise ConfigError(f"data.label must be 'fine' or 'coarse'; got {label!r}.")
    if root is None:
        root = system_root(name)
        if root is None:
            raise MissingDataError(no_root_message(name))
    else:
        _check_root(name, Path(root).expanduser(), download=download)
    try:
        folder, version = resolve(name, root)
    except MissingDataError:
        from .download import download as fetch
        from .download import missing_message

        if not download:
            raise MissingDataError(missing_message(name, root)) from None
        fetch(name, root)
        folder, version = resolve(name, root)
    if version == "idx":
        paths = [find_file(folder, f, "idx") for f in IDX_FILES]
        xtr, ytr = load_idx_pair(paths[0], paths[1], num_classes=10, dataset=name)  # type: ignore[arg-type]
        xte, yte = load_idx_pair(paths[2], paths[3], num_classes=10, dataset=name)  # type: ignore[arg-type]
        xtr, xte = xtr[:, None], xte[:, None]
        classes = 10
    else:
        xtr, ytr, xte, yte = load_cifar(folder, classes=10 if name == "cifar10" else 100, version=version,
                                        label=label)
        classes = NUM_CLASSES[name] if name == "cifar10" or label == "fine" else 20
    return LoadedData(train_x=_tensor_images(xtr, as_float), train_y=torch.from_numpy(ytr),
                      test_x=_tensor_images(xte, as_float), test_y=torch.from_numpy(yte), num_classes=classes,
                      input_shape=tuple(int(s) for s in xtr.shape[1:]), name=name)


def _check_root(name: str, root: Path, *, download: bool) -> None:
    """Refuse a data root that is a file or a dangling link, or a folder that does not exist when
    nothing will create it.

    Raises:
        MissingDataError: the message names ``data.root`` and the fix.
    """
    installed = " (or drop data.root: make data installs it where it is found without one)" \
        if name in SYSTEM_ROOTS else ""
    if root.is_symlink() and not root.exists():
        raise MissingDataError(f"data.root={root} is a symbolic link to nothing (or a loop): give the folder that "
                               f"holds the {name} files{installed}.")
    if root.exists() and not root.is_dir():
        raise MissingDataError(f"data.root={root} is a file, not a folder: give the folder that holds the {name} "
                               f"files{installed}.")
    if not root.exists() and not download:
        raise MissingDataError(f"data.root={root} does not exist: give the folder that holds the {name} files, "
                               f"or data.download=true to fetch them into it where a network is{installed}.")


def no_root_message(name: str) -> str:
    """What to do when data set ``name`` is asked for without a root and no system package holds it."""
    check_name(name)
    where = " or ".join(SYSTEM_ROOTS.get(name, ()))
    found = f"; it is not installed in {where} either" if where else ""
    pkg = " (`make data` installs Debian's dataset-fashion-mnist)" if name == "fashion_mnist" else ""
    return (f"data={name} needs data.root=DIR, the folder holding (or receiving, with data.download=true) its "
            f"published files{found}{pkg}.")


_FORMS = ("a LoadedData; a tuple (train_x, train_y, test_x, test_y) of tensors or arrays; a dict with those "
          "keys; or a tuple (train_dataset, test_dataset) of torch Datasets yielding (x, y)")


def _as_tensor(v: Any, what: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    raise ConfigError(f"the data builder's {what} must be a tensor or numpy array; got {type(v).__name__}. "
                      f"Accepted return values: {_FORMS}.")


def _materialise(ds: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        items = [ds[i] for i in range(len(ds))]
    except TypeError as e:
        raise ConfigError(f"the data builder's {what} is not a map-style Dataset (needs __len__ and "
                          f"__getitem__): {e}. Accepted return values: {_FORMS}.") from e
    if not items:
        return torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    xs = [torch.as_tensor(it[0]) for it in items]
    return torch.stack(xs), torch.as_tensor([int(it[1]) for it in items], dtype=torch.int64)


def from_user(obj: Any, *, num_classes: Optional[int] = None, name: str = "custom") -> LoadedData:
    """Turn what a user's data builder (``data._target_``) returned into a :class:`LoadedData`.

    Accepted: a :class:`LoadedData`; a tuple or list ``(train_x, train_y, test_x, test_y)`` of
    tensors or numpy arrays; a mapping with those keys; or a pair ``(train, test)`` of map-style
    torch Datasets whose items are ``(x, y)`` (materialised once, so keep them small enough for
    memory). Labels become int64; ``num_classes`` defaults to ``max label + 1`` over both splits.

    Raises:
        ConfigError: another shape of return value, mismatched lengths, non-integer or negative
            labels, or a label ``>= num_classes`` (each message says which and how to fix it).

    Example:
        >>> import torch
        >>> d = from_user((torch.zeros(4, 2), torch.tensor([0, 1, 2, 1]), torch.zeros(2, 2), torch.tensor([0, 2])))
        >>> d.num_classes, d.input_shape, d.train_y.dtype
        (3, (2,), torch.int64)
    """
    if isinstance(obj, LoadedData):
        return obj
    if isinstance(obj, Mapping):
        missing = [k for k in ("train_x", "train_y", "test_x", "test_y") if k not in obj]
        if missing:
            raise ConfigError(f"the data builder's dict lacks {missing}. Accepted return values: {_FORMS}.")
        parts: Sequence[Any] = [obj["train_x"], obj["train_y"], obj["test_x"], obj["test_y"]]
    elif isinstance(obj, (tuple, list)):
        parts = list(obj)
    else:
        raise ConfigError(f"the data builder returned {type(obj).__name__}. Accepted return values: {_FORMS}.")
    if len(parts) == 2:
        xtr, ytr = _materialise(parts[0], "train set")
        xte, yte = _materialise(parts[1], "test set")
    elif len(parts) == 4:
        xtr, ytr, xte, yte = (_as_tensor(v, w) for v, w in zip(parts, ("train_x", "train_y", "test_x", "test_y")))
    else:
        raise ConfigError(f"the data builder returned {len(parts)} values. Accepted return values: {_FORMS}.")
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if len(x) != len(y):
            raise ConfigError(f"the data builder's {split} split has {len(x)} inputs but {len(y)} labels.")
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool or y.ndim != 1:
            raise ConfigError(f"the data builder's {split} labels must be a 1-d integer tensor; got {y.dtype} of "
                              f"shape {tuple(y.shape)}.")
    ytr, yte = ytr.to(torch.int64), yte.to(torch.int64)
    if len(xtr) == 0:
        raise ConfigError("the data builder's train split is empty.")
    if len(xte) and tuple(xte.shape[1:]) != tuple(xtr.shape[1:]):
        raise ConfigError(f"the data builder's train and test inputs differ in shape: {tuple(xtr.shape[1:])} vs "
                          f"{tuple(xte.shape[1:])}.")
    top = int(max(ytr.max(), yte.max() if len(yte) else ytr.max()))
    low = int(min(ytr.min(), yte.min() if len(yte) else ytr.min()))
    classes = top + 1 if num_classes is None else int(num_classes)
    if low < 0 or top >= classes:
        raise ConfigError(f"the data builder's labels span [{low}, {top}]; they must lie in [0, {classes}) "
                          "(data.num_classes).")
    return LoadedData(train_x=xtr, train_y=ytr, test_x=xte, test_y=yte, num_classes=classes,
                      input_shape=tuple(int(s) for s in xtr.shape[1:]), name=name)
