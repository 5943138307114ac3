"""The IDX file format of MNIST and Fashion-MNIST (``train-images-idx3-ubyte[.gz]`` and friends).

Layout (LeCun, Cortes, Burges, "The MNIST database of handwritten digits", 1998): a 4-byte magic
number ``0x00 0x00 T k`` (``T`` the element type, ``k`` the number of dimensions), then ``k``
big-endian unsigned 32-bit sizes, then the ``prod(sizes)`` elements in row-major (C) order,
big-endian. Types: ``0x08`` uint8, ``0x09`` int8, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32,
``0x0E`` float64.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import DataFileError
from ._files import read_bytes

__all__ = ["IDX_TYPES", "read_idx", "parse_idx", "load_idx_pair"]

#: IDX type code -> numpy dtype (big-endian where it matters).
IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


def parse_idx(data: bytes, *, name: str = "<bytes>", ndim: Optional[int] = None) -> np.ndarray:
    """Decode the bytes of one IDX file (already decompressed).

    Args:
        data: the file's content. name: how the messages name the file.
        ndim: the number of dimensions the caller expects (3 for images, 1 for labels), or ``None``.

    Returns:
        An array of shape ``sizes`` in the file's element type, native byte order (a copy, writable).

    Raises:
        DataFileError: bad magic number, unknown type code, a different ``ndim`` than expected,
            or a size that is not ``4 + 4k + prod(sizes) * itemsize`` bytes (the message gives both).

    Example:
        >>> parse_idx(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9])).tolist()
        [7, 8, 9]
    """
    if len(data) < 4:
        raise DataFileError(f"{name} is not an IDX file: {len(data)} bytes, shorter than the 4-byte magic number.")
    zero0, zero1, code, k = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or code not in IDX_TYPES:
        raise DataFileError(f"{name} is not an IDX file: magic bytes {data[:4].hex()} (expected 0000 then a type "
                            f"code in {sorted(hex(c) for c in IDX_TYPES)} and the number of dimensions).")
    if ndim is not None and k != ndim:
        raise DataFileError(f"{name} holds a {k}-dimensional IDX array; expected {ndim} dimensions "
                            f"({'images' if ndim == 3 else 'labels' if ndim == 1 else 'array'}).")
    header = 4 + 4 * k
    if len(data) < header:
        raise DataFileError(f"{name} is truncated: {len(data)} bytes, shorter than its {header}-byte header.")
    sizes = struct.unpack(f">{k}I", data[4:header])
    dtype = IDX_TYPES[code]
    count = 1
    for s in sizes:
        count *= s
    expected = header + count * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise DataFileError(f"{name} is {what}: {len(data)} bytes, expected {expected} "
                            f"(header: {k} dimensions {tuple(sizes)} of {dtype.itemsize}-byte elements). "
                            "Download the file again.")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(sizes)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | Path, *, ndim: Optional[int] = None) -> np.ndarray:
    """Read an IDX file, gzipped (recognised by content) or not; see :func:`parse_idx`.

    Raises:
        MissingDataError: the file does not exist.
        DataFileError: a corrupt gzip stream, or any of :func:`parse_idx`'s checks.
    """
    return parse_idx(read_bytes(path), name=str(path), ndim=ndim)


def load_idx_pair(images: str | Path, labels: str | Path, *, num_classes: int,
                  dataset: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """An images file and its labels file: ``(N, H, W)`` uint8 and ``(N,)`` int64.

    Args:
        images: the images file (gzipped or not). labels: the labels file (gzipped or not).
        num_classes: labels must lie in ``[0, num_classes)``.
        dataset: ``mnist`` or ``fashion_mnist`` to check files that declare the published
            dimensions against the published content (:func:`robustagg.data.digests.verify_content`);
            ``None``: no digest check.

    Raises:
        DataFileError: the images are not 3-d uint8, the labels not 1-d uint8, the counts differ,
            a label is outside ``[0, num_classes)``, or (with ``dataset``) a file's decompressed size
            or SHA-256 differs from the published one (the message gives both digests).
    """
    if dataset is None:
        x, y = read_idx(images, ndim=3), read_idx(labels, ndim=1)
    else:
        from .digests import read_verified

        x, y = (parse_idx(read_verified(dataset, _idx_name(p), p), name=str(p), ndim=k)
                for p, k in ((images, 3), (labels, 1)))
    if x.dtype != np.uint8 or y.dtype != np.uint8:
        raise DataFileError(f"{images} / {labels}: expected uint8 images and labels; got {x.dtype} and {y.dtype}.")
    if len(x) != len(y):
        raise DataFileError(f"{images} holds {len(x)} images but {labels} holds {len(y)} labels; "
                            "the two files must come from the same split.")
    if len(y) and int(y.max()) >= num_classes:
        raise DataFileError(f"{labels} holds label {int(y.max())}, outside [0, {num_classes}).")
    return x, y.astype(np.int64)


def _idx_name(path: str | Path) -> str:
    """The IDX file name of ``path`` without a ``.gz`` suffix."""
    name = Path(path).name
    return name[:-3] if name.endswith(".gz") else name
