"""The published *content* of the MNIST and Fashion-MNIST IDX files, and checking a file against it.

The same IDX content reaches users in differently compressed ``.gz`` files (Debian's
``dataset-fashion-mnist`` package recompressed the published archives: its ``.gz`` bytes and sizes
differ, its decompressed bytes do not), so a reader cannot verify the archive. It verifies what it
parses: the decompressed IDX bytes, against the size and SHA-256 digest below.

| data set | file | bytes | SHA-256 of the decompressed IDX |
|---|---|---:|---|
| fashion_mnist | train-images-idx3-ubyte | 47,040,016 | ``c59f468a...aa44d888`` |
| fashion_mnist | train-labels-idx1-ubyte | 60,008 | ``bad3541b...760443d9`` |
| fashion_mnist | t10k-images-idx3-ubyte | 7,840,016 | ``5b4141f0...8815ce37b`` |
| fashion_mnist | t10k-labels-idx1-ubyte | 10,008 | ``0402a96d...7dec38c34`` |
| mnist | train-images-idx3-ubyte | 47,040,016 | ``ba891046...2fc25776db`` |
| mnist | train-labels-idx1-ubyte | 60,008 | ``65a50cbb...9eef7101c5`` |
| mnist | t10k-images-idx3-ubyte | 7,840,016 | ``0fa7898d...62c4d494ce7`` |
| mnist | t10k-labels-idx1-ubyte | 10,008 | ``ff7bcfd4...e06e48f7ec33f2`` |

Sources. Sizes: ``4 + 4k + prod(sizes)`` bytes of the published headers (60,000 or 10,000 images
of 28 x 28 uint8; Xiao, Rasul, Vollgraf 2017; LeCun, Cortes, Burges 1998). Fashion-MNIST digests:
measured here on 2026-12-01 by decompressing the four files of Debian's
``dataset-fashion-mnist 0.0~git20200523.55506a9-1``; they equal the digests that independent
public download tables record for the decompressed published archives (whose gzip MD5s match the
publisher's README). MNIST digests: from such public tables (decompressed published archives, whose
``.gz`` SHA-256 is in :data:`robustagg.data.download.RESOURCES`), not re-measured here: no MNIST
files are on these machines.

Which files are checked: a file whose IDX header declares the published dimensions (say
``60000 x 28 x 28`` for ``train-images``) claims to be the published file and must match its
digest. A file that declares the dimensions of *another* published file of its data set (the
test images under the training images' name) and *is* that file (its digest) is refused: the files
are misnamed or swapped, and read as they are the model would train on the test split. A file with
dimensions other than the published ones of its name (a subset, a file a user wrote in the
format, the tests' tiny files) is read without a digest check, since there is nothing to compare
it with: :func:`verify_content` logs a warning naming it, and ``python -m experiments.data_files``
says which files were not verified. A file of a published name with no IDX header at all (an
empty file, a saved web page) is refused with both digests.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataFileError
from ._files import _GZIP_MAGIC

__all__ = ["Content", "CONTENT", "claims_published", "published_as", "verify_content", "read_verified"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Content:
    """The published content of one IDX file.

    Attributes:
        size: bytes of the decompressed file. sha256: hex digest of the decompressed file.
        dims: the dimensions its header declares (``(60000, 28, 28)``, ``(10000,)``, ...).
    """

    size: int
    sha256: str
    dims: tuple[int, ...]


_TRAIN_X, _TRAIN_Y, _TEST_X, _TEST_Y = (60000, 28, 28), (60000,), (10000, 28, 28), (10000,)


def _table(digests: tuple[str, str, str, str]) -> dict[str, Content]:
    dims = (_TRAIN_X, _TRAIN_Y, _TEST_X, _TEST_Y)
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    out = {}
    for name, d, sha in zip(names, dims, digests):
        count = 1
        for s in d:
            count *= s
        out[name] = Content(size=4 + 4 * len(d) + count, sha256=sha, dims=d)
    return out


#: Data set -> IDX file name (without ``.gz``) -> its published content.
CONTENT: dict[str, dict[str, Content]] = {
    "fashion_mnist": _table(("c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
                             "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
                             "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
                             "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34")),
    "mnist": _table(("ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
                     "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
                     "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
                     "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2")),
}


def _header_dims(data: bytes) -> tuple[int, ...] | None:
    """The dimensions an IDX header declares, or ``None`` when ``data`` has no complete header."""
    if len(data) < 4 or data[0] or data[1]:
        return None
    k = data[3]
    if len(data) < 4 + 4 * k:
        return None
    return tuple(struct.unpack(f">{k}I", data[4:4 + 4 * k]))


def claims_published(name: str, filename: str, data: bytes) -> bool:
    """Whether ``data`` (decompressed IDX bytes) declares the published dimensions of ``filename``
    of data set ``name`` (and so must match its digest). Unknown data sets or files: ``False``.

    Example:
        >>> claims_published("fashion_mnist", "t10k-labels-idx1-ubyte", bytes([0, 0, 8, 1, 0, 0, 39, 16]))
        True
        >>> claims_published("fashion_mnist", "t10k-labels-idx1-ubyte", bytes([0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3]))
        False
    """
    c = CONTENT.get(name, {}).get(filename)
    return c is not None and _header_dims(data) == c.dims


def published_as(name: str, data: bytes) -> str | None:
    """The published file of data set ``name`` whose dimensions the IDX header of ``data`` declares
    (``"t10k-images-idx3-ubyte"``, ...), or ``None`` when it declares no published file's.

    Example:
        >>> published_as("fashion_mnist", bytes([0, 0, 8, 1, 0, 0, 234, 96]))
        'train-labels-idx1-ubyte'
        >>> published_as("fashion_mnist", bytes([0, 0, 8, 1, 0, 0, 0, 3])) is None
        True
    """
    dims = _header_dims(data)
    return next((f for f, c in CONTENT.get(name, {}).items() if dims == c.dims), None)


def _fix(path: str | Path, name: str) -> str:
    """How to replace a bad copy of a published file of ``name`` at ``path``."""
    from .folders import SYSTEM_ROOTS

    p = Path(path).resolve()
    if any(Path(r).resolve() in p.parents for r in SYSTEM_ROOTS.get(name, ())):
        return ("reinstall the package that installed it (sudo apt-get install --reinstall dataset-fashion-mnist; "
                "make data only installs it when absent)")
    package = f" or copy it from the installed package ({', '.join(SYSTEM_ROOTS[name])})" if name in SYSTEM_ROOTS else ""
    return f"delete it and fetch the published file (data.download=true where a network is){package}"


def _identify(got: str) -> str:
    """``" (it is the published <data set> file <name>)"`` when digest ``got`` is one of :data:`CONTENT`'s."""
    for ds, files in CONTENT.items():
        for f, c in files.items():
            if c.sha256 == got:
                return f" (it is the published {ds} file {f})"
    return ""


def verify_content(name: str, filename: str, data: bytes, *, path: str | Path) -> None:
    """Refuse decompressed bytes under a published file's name that are not that file.

    Args:
        name: the data set (``mnist`` or ``fashion_mnist``). filename: the IDX name without ``.gz``.
        data: the decompressed file content. path: how the message names the file on disk.

    Raises:
        DataFileError: ``data`` declares the published dimensions of ``filename`` but its size or
            SHA-256 differ from :data:`CONTENT` (corrupt, truncated, or another data set's); or it
            has no IDX header at all (an empty file, a saved web page); or it *is* another
            published file of ``name`` (same digest: the files are misnamed or swapped). Each
            message names the file and gives both digests, or both file names.
    """
    own = CONTENT.get(name, {}).get(filename)
    if own is None:
        return
    got = hashlib.sha256(data).hexdigest()
    dims = _header_dims(data)
    if dims is None:
        raise DataFileError(
            f"{path} has no IDX header: {len(data)} bytes (sha256 {got}) where the published {name} file {filename} "
            f"is {own.size} bytes (sha256 {own.sha256}). {_fix(path, name)[0].upper()}{_fix(path, name)[1:]}.")
    as_file = published_as(name, data)
    if as_file is not None and as_file != filename and got == CONTENT[name][as_file].sha256:
        raise DataFileError(
            f"{path} is the published {name} file {as_file} (sha256 {got}), not {filename}: the files are misnamed "
            "or swapped. Give each file its published name.")
    if as_file != filename:
        log.warning("%s declares %s, not the published %s of %s %s: read without a digest check", path, dims,
                    own.dims, name, filename)
        return
    if len(data) != own.size or got != own.sha256:
        raise DataFileError(
            f"{path} is not the published {name} file {filename}: its decompressed content is {len(data)} bytes "
            f"with sha256 {got}{_identify(got)}, the published one {own.size} bytes with sha256 {own.sha256}. "
            f"The file is corrupt, truncated or of another data set: {_fix(path, name)}.")


def _gunzip_member(raw: bytes) -> tuple[bytes, bytes, bool]:
    """One gzip member at the start of ``raw``: what it decompresses to before any damage, the
    bytes after it, and whether it ended cleanly.

    Fed 4 KiB at a time; a piece that fails is fed again byte by byte from the state before it
    (:meth:`zlib.Decompress.copy`), so the output of every byte before the damage is kept.
    """
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = []
    step = 1 << 12
    for i in range(0, len(raw), step):
        piece, before = raw[i:i + step], d.copy()
        try:
            out.append(d.decompress(piece))
        except zlib.error:
            d = before
            for j in range(len(piece)):
                try:
                    out.append(d.decompress(piece[j:j + 1]))
                except zlib.error:
                    break
            return b"".join(out), b"", False
        if d.eof:
            return b"".join(out), d.unused_data + raw[i + step:], True
    return b"".join(out), b"", False


def _gunzip_prefix(raw: bytes) -> bytes:
    """Every byte a (possibly truncated or corrupt) gzip file decompresses to before it fails,
    over all its members (``cat a.gz b.gz``, BGZF) as :func:`gzip.decompress` reads them."""
    out = []
    rest = raw
    while rest[:2] == _GZIP_MAGIC:
        part, rest, clean = _gunzip_member(rest)
        out.append(part)
        if not clean:
            break
    return b"".join(out)


def read_verified(name: str, filename: str, path: str | Path) -> bytes:
    """The decompressed content of the IDX file at ``path``, checked with :func:`verify_content`.

    A gzip stream that stops early or is corrupt is refused with the digest of what could be
    decompressed next to the published one, so a truncated or damaged download names both
    digests too (for a file of a published name; others get the plain message).

    Raises:
        MissingDataError: ``path`` does not exist.
        DataFileError: a corrupt gzip stream, or any of :func:`verify_content`'s checks.
    """
    from ._files import read_bytes

    try:
        data = read_bytes(path)
    except DataFileError:
        c = CONTENT.get(name, {}).get(filename)
        try:
            raw = Path(path).read_bytes()
        except OSError:  # unreadable: read_bytes's own message says so
            raw = b""
        if c is None or raw[:2] != _GZIP_MAGIC:
            raise
        prefix = _gunzip_prefix(raw)
        got = hashlib.sha256(prefix).hexdigest()
        if len(prefix) == c.size and got == c.sha256:
            raise DataFileError(
                f"{path} decompresses to the published {name} file {filename} (sha256 {got}), but its gzip "
                f"container is damaged ({len(raw)} bytes on disk: a bad trailer or bytes after the stream): "
                f"{_fix(path, name)}, or place the uncompressed file next to it.") from None
        raise DataFileError(
            f"{path} is a truncated or corrupt gzip file ({len(raw)} bytes on disk): {len(prefix)} bytes decompress "
            f"(sha256 {got}) where the published {name} file {filename} is {c.size} bytes (sha256 {c.sha256}). "
            f"{_fix(path, name)[0].upper()}{_fix(path, name)[1:]}.") from None
    verify_content(name, filename, data, path=path)
    return data
