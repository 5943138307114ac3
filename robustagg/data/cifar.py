"""CIFAR-10 and CIFAR-100 in both of their published on-disk versions, without torchvision.

Source: Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", tech. report, 2009;
the formats as documented on https://www.cs.toronto.edu/~kriz/cifar.html.

- **Binary version**: a flat sequence of records. CIFAR-10 (``data_batch_1.bin`` ..
  ``data_batch_5.bin``, ``test_batch.bin``): 1 label byte + 3072 pixel bytes. CIFAR-100
  (``train.bin``, ``test.bin``): 1 coarse-label byte, 1 fine-label byte, 3072 pixel bytes.
- **Python version**: a Python 2 pickle (protocol 2) per batch, a dict with byte-string keys:
  ``b"data"`` a ``(N, 3072)`` uint8 ndarray, ``b"labels"`` (CIFAR-10) or ``b"fine_labels"`` and
  ``b"coarse_labels"`` (CIFAR-100) lists of ints, plus ``b"filenames"`` and ``b"batch_label"``.

The 3072 pixel bytes of one image are the 1024 red, then 1024 green, then 1024 blue values of a
32x32 image in row-major order, so both versions reshape to ``(N, 3, 32, 32)``.

Note:
    A pickle can call any importable function while it loads. :class:`RestrictedUnpickler`
    resolves exactly the three globals the published CIFAR pickles reference (numpy's
    ``_reconstruct``, ``ndarray`` and ``dtype``: the pieces of a pickled ndarray) to numpy's own
    objects and refuses every other one, so a tampered file cannot run code. A pickle re-saved by
    Python 3 with protocol < 3 also references ``_codecs.encode`` (for bytes) and is refused:
    keep the original files or use the binary version.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from ..errors import DataFileError
from ._files import read_bytes

__all__ = ["RECORD_PIXELS", "RestrictedUnpickler", "safe_unpickle", "parse_cifar_binary", "read_cifar_binary",
           "read_cifar_python", "CIFAR10_BIN", "CIFAR10_PY", "CIFAR100_BIN", "CIFAR100_PY", "load_cifar"]

#: Pixel bytes of one 3x32x32 image.
RECORD_PIXELS = 3 * 32 * 32

#: File names of each version: ``(train files, test files)``.
CIFAR10_BIN = ([f"data_batch_{i}.bin" for i in range(1, 6)], ["test_batch.bin"])
CIFAR10_PY = ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"])
CIFAR100_BIN = (["train.bin"], ["test.bin"])
CIFAR100_PY = (["train"], ["test"])


def _numpy_reconstruct() -> Callable[..., Any]:
    try:  # numpy >= 2 keeps it in numpy._core; the files name the numpy 1 location
        from numpy._core.multiarray import _reconstruct  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined,no-redef]
    return _reconstruct  # type: ignore[no-any-return]


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` that admits only the globals a pickled numpy ndarray needs.

    Allowed (module, name) pairs, each resolved to numpy's object directly (never imported by the
    name in the file): ``("numpy.core.multiarray", "_reconstruct")``, ``("numpy", "ndarray")`` and
    ``("numpy", "dtype")``. These are exactly the globals of the published CIFAR python batches
    (written by Python 2 and numpy 1, hence the ``numpy.core`` name even under numpy 2). Plain
    containers, numbers and strings need no global.

    Raises:
        DataFileError: (from ``load``) the pickle references any other global; the message names it.

    Example:
        >>> import io, pickle
        >>> bad = pickle.dumps(print, protocol=2)
        >>> RestrictedUnpickler(io.BytesIO(bad)).load()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        robustagg.errors.DataFileError: refused to unpickle the global __builtin__.print in <pickle>: ...
    """

    _ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
        ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
        ("numpy", "ndarray"): lambda: np.ndarray,
        ("numpy", "dtype"): lambda: np.dtype,
    }

    def __init__(self, file: Any, *, name: str = "<pickle>") -> None:
        super().__init__(file, encoding="bytes")
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        get = self._ALLOWED.get((module, name))
        if get is None:
            raise DataFileError(f"refused to unpickle the global {module}.{name} in {self._name}: only numpy "
                                "arrays are admitted (a CIFAR python batch needs nothing else). The file is "
                                "not an original CIFAR batch; use the binary version or fetch it again.")
        return get()


def safe_unpickle(data: bytes, *, name: str = "<pickle>") -> Any:
    """Load ``data`` with :class:`RestrictedUnpickler` (byte strings stay ``bytes``).

    Raises:
        DataFileError: a refused global, or a truncated / corrupt pickle (the message names ``name``).
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), name=name).load()
    except DataFileError:
        raise
    except Exception as e:  # truncated or garbled streams raise many types (EOFError, UnpicklingError, ...)
        raise DataFileError(f"{name} is not a readable CIFAR python batch ({type(e).__name__}: {e}); "
                            "it is truncated or corrupt. Download it again.") from e


def parse_cifar_binary(data: bytes, *, label_bytes: int, name: str = "<bytes>") -> tuple[np.ndarray, np.ndarray]:
    """Decode the records of one binary-version file.

    Args:
        data: the file's content. label_bytes: 1 (CIFAR-10) or 2 (CIFAR-100: coarse, fine).
        name: how the messages name the file.

    Returns:
        ``(images, labels)``: ``(N, 3, 32, 32)`` uint8 and ``(N, label_bytes)`` uint8 (copies).

    Raises:
        DataFileError: empty, or the size is not a multiple of the ``label_bytes + 3072`` record.

    Example:
        >>> x, y = parse_cifar_binary(bytes([7]) + bytes(3072), label_bytes=1)
        >>> x.shape, y.tolist()
        ((1, 3, 32, 32), [[7]])
    """
    record = label_bytes + RECORD_PIXELS
    if len(data) == 0 or len(data) % record:
        raise DataFileError(f"{name} is truncated or not a CIFAR binary file: {len(data)} bytes is not a positive "
                            f"multiple of the {record}-byte record ({label_bytes} label byte(s) + {RECORD_PIXELS} "
                            f"pixels); {len(data) // record} whole record(s) and {len(data) % record} stray bytes. "
                            "Download it again.")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    return rows[:, label_bytes:].reshape(-1, 3, 32, 32).copy(), rows[:, :label_bytes].copy()


def read_cifar_binary(path: str | Path, *, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read one binary-version file (gzipped or not); see :func:`parse_cifar_binary`.

    Raises:
        MissingDataError: the file does not exist.
        DataFileError: see :func:`parse_cifar_binary`.
    """
    return parse_cifar_binary(read_bytes(path), label_bytes=label_bytes, name=str(path))


def read_cifar_python(path: str | Path, *, label_keys: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Read one python-version batch with :class:`RestrictedUnpickler`.

    Args:
        path: the batch file. label_keys: the label lists to return (``["labels"]`` for CIFAR-10,
            ``["fine_labels", "coarse_labels"]`` for CIFAR-100).

    Returns:
        ``(images, labels)``: ``(N, 3, 32, 32)`` uint8 and ``{key: (N,) int64}``.

    Raises:
        MissingDataError: the file does not exist.
        DataFileError: a refused global, a corrupt pickle, or content not shaped like a CIFAR batch
            (not a dict, ``data`` not ``(N, 3072)`` uint8, a label list missing or of another length).
    """
    name = str(path)
    obj = safe_unpickle(read_bytes(path), name=name)
    if not isinstance(obj, dict):
        raise DataFileError(f"{name}: a CIFAR python batch is a dict; got {type(obj).__name__}.")
    d = {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}
    data = d.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != RECORD_PIXELS:
        got = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataFileError(f"{name}: 'data' must be a uint8 array of shape (N, {RECORD_PIXELS}); got {got}.")
    labels: dict[str, np.ndarray] = {}
    for key in label_keys:
        lab = d.get(key)
        if not isinstance(lab, (list, np.ndarray)) or len(lab) != len(data):
            raise DataFileError(f"{name}: {key!r} must be a list of {len(data)} labels; got "
                                f"{type(lab).__name__}{'' if lab is None else f' of length {len(lab)}'}. "
                                f"Keys present: {sorted(d)}.")
        try:
            labels[key] = np.asarray(lab, dtype=np.int64)
        except (TypeError, ValueError) as e:
            raise DataFileError(f"{name}: {key!r} must hold integers ({e}).") from e
    return data.reshape(-1, 3, 32, 32).copy(), labels


def _check_range(y: np.ndarray, num_classes: int, name: str) -> None:
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataFileError(f"{name} holds labels in [{int(y.min())}, {int(y.max())}], outside [0, {num_classes}).")


def load_cifar(folder: str | Path, *, classes: Literal[10, 100], version: Literal["binary", "python"],
               label: Literal["fine", "coarse"] = "fine") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The train and test split of CIFAR-10 or CIFAR-100 from one folder of either version.

    Args:
        folder: the folder holding the files (e.g. ``cifar-10-batches-bin`` or ``cifar-100-python``).
        classes: 10 or 100. version: ``binary`` or ``python`` (file names in :data:`CIFAR10_BIN` ...).
        label: CIFAR-100 only: ``fine`` (100 classes) or ``coarse`` (20 superclasses).

    Returns:
        ``(train_x, train_y, test_x, test_y)``: ``(N, 3, 32, 32)`` uint8 images and ``(N,)`` int64
        labels, in file order (50000 / 10000 examples for the published sets).

    Raises:
        ConfigError: ``classes``, ``version`` or ``label`` not one of the values above.
        MissingDataError: a file is missing. DataFileError: a file is corrupt (see the readers).
    """
    from ..errors import ConfigError

    if classes not in (10, 100):
        raise ConfigError(f"classes must be 10 or 100; got {classes!r}.")
    if version not in ("binary", "python"):
        raise ConfigError(f"version must be 'binary' or 'python'; got {version!r}.")
    if label not in ("fine", "coarse"):
        raise ConfigError(f"label must be 'fine' or 'coarse'; got {label!r}.")
    root = Path(folder)
    if classes == 10:
        files = CIFAR10_BIN if version == "binary" else CIFAR10_PY
    else:
        files = CIFAR100_BIN if version == "binary" else CIFAR100_PY
    n_classes = 10 if classes == 10 else (100 if label == "fine" else 20)
    out: list[np.ndarray] = []
    for names in files:
        xs, ys = [], []
        for fname in names:
            path = root / fname
            if version == "binary":
                x, lab = read_cifar_binary(path, label_bytes=1 if classes == 10 else 2)
                y = lab[:, 0] if classes == 10 else lab[:, 1 if label == "fine" else 0]
                y = y.astype(np.int64)
            else:
                key = "labels" if classes == 10 else f"{label}_labels"
                x, labs = read_cifar_python(path, label_keys=[key])
                y = labs[key]
            _check_range(y, n_classes, str(path))
            xs.append(x)
            ys.append(y)
        out += [np.concatenate(xs), np.concatenate(ys)]
    return out[0], out[1], out[2], out[3]
