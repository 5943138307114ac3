"""Where a data set's files may lie under a root folder, and which of those places holds them.

Other tools leave the same published files in their own folder layouts; :func:`resolve` accepts
the root itself and the common ones, so files already on disk are reused:

| data set | version | folders tried under ``root``, in order |
|---|---|---|
| ``mnist`` | IDX | ``.``, ``MNIST/raw``, ``MNIST``, ``mnist`` |
| ``fashion_mnist`` | IDX | ``.``, ``FashionMNIST/raw``, ``FashionMNIST``, ``fashion_mnist``, ``fashion-mnist`` |
| ``cifar10`` | binary / python | ``.``, ``cifar-10-batches-bin`` / ``.``, ``cifar-10-batches-py`` |
| ``cifar100`` | binary / python | ``.``, ``cifar-100-binary`` / ``.``, ``cifar-100-python`` |

IDX files count with or without ``.gz`` (the uncompressed copy wins when both exist). MNIST and
Fashion-MNIST share their file names: a root that holds the files directly is taken for whichever
of the two was asked for, so keep each in its own folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ConfigError, MissingDataError
from .cifar import CIFAR10_BIN, CIFAR10_PY, CIFAR100_BIN, CIFAR100_PY

__all__ = ["DATASETS", "Layout", "LAYOUTS", "IDX_FILES", "SYSTEM_ROOTS", "check_name", "find_file", "resolve",
           "system_root"]

#: The data sets read from their published files.
DATASETS = ("mnist", "fashion_mnist", "cifar10", "cifar100")

Version = Literal["idx", "binary", "python"]

#: The four IDX files of MNIST and Fashion-MNIST (each may carry ``.gz``).
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class Layout:
    """One place a data set's files may be: ``root / folder`` holding every name in ``files``.

    Attributes:
        version: ``idx``, ``binary`` or ``python`` (the reader to use).
        folder: relative to the root (``""`` is the root itself).
        files: the file names that must all exist (IDX names without ``.gz``).
    """

    version: Version
    folder: str
    files: tuple[str, ...]


def _cifar(files: tuple[list[str], list[str]]) -> tuple[str, ...]:
    return tuple(files[0] + files[1])


#: Data set -> the layouts :func:`resolve` tries, in order.
LAYOUTS: dict[str, tuple[Layout, ...]] = {
    "mnist": tuple(Layout("idx", f, IDX_FILES) for f in ("", "MNIST/raw", "MNIST", "mnist")),
    "fashion_mnist": tuple(Layout("idx", f, IDX_FILES)
                           for f in ("", "FashionMNIST/raw", "FashionMNIST", "fashion_mnist", "fashion-mnist")),
    "cifar10": (Layout("binary", "", _cifar(CIFAR10_BIN)), Layout("python", "", _cifar(CIFAR10_PY)),
                Layout("binary", "cifar-10-batches-bin", _cifar(CIFAR10_BIN)),
                Layout("python", "cifar-10-batches-py", _cifar(CIFAR10_PY))),
    "cifar100": (Layout("binary", "", _cifar(CIFAR100_BIN)), Layout("python", "", _cifar(CIFAR100_PY)),
                 Layout("binary", "cifar-100-binary", _cifar(CIFAR100_BIN)),
                 Layout("python", "cifar-100-python", _cifar(CIFAR100_PY))),
}


#: Data set -> folders where an operating-system package installs its files, tried when no root
#: is given: Debian's ``dataset-fashion-mnist`` (``make data`` installs it) puts the four ``.gz``
#: files in ``/usr/share/datasets/fashion-mnist``.
SYSTEM_ROOTS: dict[str, tuple[str, ...]] = {"fashion_mnist": ("/usr/share/datasets/fashion-mnist",)}


def system_root(name: str) -> Path | None:
    """The first folder of :data:`SYSTEM_ROOTS` that holds data set ``name`` completely, or ``None``.

    Raises:
        ConfigError: unknown ``name``.
    """
    check_name(name)
    for folder in SYSTEM_ROOTS.get(name, ()):
        try:
            resolve(name, folder)
        except MissingDataError:
            continue
        return Path(folder)
    return None


def find_file(folder: Path, name: str, version: Version) -> Path | None:
    """``folder / name`` if it is a file; for IDX also ``name + ".gz"``; else ``None``."""
    p = folder / name
    if p.is_file():
        return p
    if version == "idx" and (folder / f"{name}.gz").is_file():
        return folder / f"{name}.gz"
    return None


def check_name(name: str) -> str:
    """``name`` if it is one of :data:`DATASETS`.

    Raises:
        ConfigError: another name (the message lists the known ones).
    """
    if name not in LAYOUTS:
        raise ConfigError(f"unknown data set {name!r}; the file-based data sets are {', '.join(DATASETS)} "
                          "(data=hf for a Hugging Face data set, data._target_ for your own).")
    return name


def resolve(name: str, root: str | Path) -> tuple[Path, Version]:
    """The folder under ``root`` that holds every file of data set ``name``, and its version.

    Raises:
        ConfigError: unknown ``name``.
        MissingDataError: no layout is complete (:func:`robustagg.data.load` turns it into the
            message of :func:`robustagg.data.download.missing_message`: which files to place where).
    """
    check_name(name)
    base = Path(root).expanduser()
    for lay in LAYOUTS[name]:
        folder = base / lay.folder if lay.folder else base
        if all(find_file(folder, f, lay.version) is not None for f in lay.files):
            return folder, lay.version
    raise MissingDataError(f"data set {name} not found under {base} (none of its folder layouts is complete).")
