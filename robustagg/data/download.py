"""The published files of each data set, their SHA-256 digests, fetching them, and what to do offline.

Every fetched file is verified against the SHA-256 digest in :data:`RESOURCES` before it is
renamed into place (a partial or tampered download never reaches a reader); archives are then
extracted member by member, refusing links, devices and paths that leave the target folder.

Digests and sizes (bytes) are those of the published files as recorded in TensorFlow Datasets'
checksum files (Keras' ``file_hash`` for the two CIFAR python archives), each cross-checked
against at least one further independent public download table (e.g. Julia's MLDatasets, the Hugging
Face datasets server for MNIST). MNIST is fetched from the mirror those digests were recorded on
first (``storage.googleapis.com/cvdf-datasets``), then from PyTorch's copy; a mirror whose bytes
differ is skipped.

Where no network exists, :func:`missing_message` says which files to place in which folder.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import DataFileError, MissingDataError
from .folders import LAYOUTS, check_name

__all__ = ["Resource", "RESOURCES", "ALTERNATIVES", "DEST", "sha256_of", "missing_message", "download",
           "safe_extract"]


@dataclass(frozen=True)
class Resource:
    """One published file.

    Attributes:
        filename: the published name. sha256: hex digest of the file as published. size: bytes.
        urls: mirrors, tried in order. archive: a ``.tar.gz`` to extract into the root
            (``members_under`` is the one folder every member must lie in).
    """

    filename: str
    sha256: str
    size: int
    urls: tuple[str, ...]
    members_under: Optional[str] = None


_MNIST = ("https://storage.googleapis.com/cvdf-datasets/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/")
_FASHION = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_KRIZ = "https://www.cs.toronto.edu/~kriz/"


def _idx(bases: tuple[str, ...], name: str, sha: str, size: int) -> Resource:
    return Resource(name, sha, size, tuple(b + name for b in bases))


#: Data set -> the files :func:`download` fetches (the CIFAR sets in their binary version: no pickle).
RESOURCES: dict[str, tuple[Resource, ...]] = {
    "mnist": (
        _idx(_MNIST, "train-images-idx3-ubyte.gz", "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
             9912422),
        _idx(_MNIST, "train-labels-idx1-ubyte.gz", "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
             28881),
        _idx(_MNIST, "t10k-images-idx3-ubyte.gz", "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
             1648877),
        _idx(_MNIST, "t10k-labels-idx1-ubyte.gz", "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
             4542),
    ),
    "fashion_mnist": (
        _idx(_FASHION, "train-images-idx3-ubyte.gz",
             "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880),
        _idx(_FASHION, "train-labels-idx1-ubyte.gz",
             "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515),
        _idx(_FASHION, "t10k-images-idx3-ubyte.gz",
             "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102),
        _idx(_FASHION, "t10k-labels-idx1-ubyte.gz",
             "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148),
    ),
    "cifar10": (Resource("cifar-10-binary.tar.gz", "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
                         170052171, (_KRIZ + "cifar-10-binary.tar.gz",), members_under="cifar-10-batches-bin"),),
    "cifar100": (Resource("cifar-100-binary.tar.gz", "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
                          168513733, (_KRIZ + "cifar-100-binary.tar.gz",), members_under="cifar-100-binary"),),
}

#: The python-version archives (not fetched, but accepted once extracted; listed in the messages).
ALTERNATIVES: dict[str, tuple[Resource, ...]] = {
    "cifar10": (Resource("cifar-10-python.tar.gz", "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
                         170498071, (_KRIZ + "cifar-10-python.tar.gz",), members_under="cifar-10-batches-py"),),
    "cifar100": (Resource("cifar-100-python.tar.gz", "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
                          169001437, (_KRIZ + "cifar-100-python.tar.gz",), members_under="cifar-100-python"),),
}

#: Data set -> the folder under the root that :func:`download` writes the files into (archives
#: are extracted into the root itself, creating their own folder).
DEST: dict[str, str] = {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw", "cifar10": "", "cifar100": ""}


def sha256_of(path: str | Path, *, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 digest of a file, read in chunks of ``chunk`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _describe(r: Resource) -> str:
    return f"{r.filename} ({r.size} bytes, sha256 {r.sha256}) from {r.urls[0]}"


def missing_message(name: str, root: str | Path) -> str:
    """What to place where so that data set ``name`` loads from ``root`` without a network.

    Raises:
        ConfigError: unknown ``name``.

    Example:
        >>> print(missing_message("cifar100", "/data").splitlines()[0])
        data set cifar100 not found under /data. Without a network, place its files by hand:
    """
    check_name(name)
    base = Path(root)
    lines = [f"data set {name} not found under {base}. Without a network, place its files by hand:"]
    if name in ("mnist", "fashion_mnist"):
        dest = base / DEST[name]
        lines.append(f"  into {dest} (or directly into {base}), gzipped or not:")
        lines += [f"    {_describe(r)}" for r in RESOURCES[name]]
        lines.append("  (any gzip of the same content will do: the decompressed files are what is verified, "
                     "robustagg.data.digests).")
        if name == "fashion_mnist":
            lines.append("Or run `make data`: it installs Debian's dataset-fashion-mnist package, found without "
                         "data.root.")
    else:
        for r in RESOURCES[name] + ALTERNATIVES[name]:
            lay = next(lay for lay in LAYOUTS[name] if lay.folder == r.members_under)
            lines.append(f"  extract {_describe(r)}")
            lines.append(f"    in {base}, giving {base / str(r.members_under)}/ with {', '.join(lay.files)}")
        lines.append("  (either version is enough; the binary one is read without any pickle).")
    lines.append("Or pass download=True (data.download=true) where a network exists.")
    return "\n".join(lines)


def safe_extract(archive: str | Path, dest: str | Path, *, members_under: str) -> None:
    """Extract a ``.tar.gz`` into ``dest``, admitting only regular files and folders under
    ``members_under/``.

    Raises:
        DataFileError: a member is a link or device, is absolute, contains ``..``, or lies outside
            ``members_under``; or the archive is corrupt. Nothing is extracted in that case.
    """
    dest = Path(dest)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                parts = Path(m.name).parts
                if (not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts
                        or not parts or parts[0] != members_under):
                    raise DataFileError(f"{archive}: refused to extract member {m.name!r} (only regular files and "
                                        f"folders under {members_under}/ are expected).")
            kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **kwargs)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataFileError(f"{archive} is a corrupt or truncated archive ({e}); delete it and download again.") from e


UrlOpen = Callable[..., Any]


def _fetch(r: Resource, target: Path, *, timeout: float, urlopen: UrlOpen) -> list[str]:
    """Fetch ``r`` to ``target`` from the first mirror that delivers the right bytes; the failures."""
    failures = []
    part = target.with_name(target.name + ".part")
    for url in r.urls:
        h = hashlib.sha256()
        try:
            with urlopen(url, timeout=timeout) as resp, open(part, "wb") as out:
                while block := resp.read(1 << 20):
                    h.update(block)
                    out.write(block)
        except (urllib.error.URLError, OSError, ValueError) as e:
            failures.append(f"{url}: {e}")
            part.unlink(missing_ok=True)
            continue
        if h.hexdigest() != r.sha256:
            failures.append(f"{url}: sha256 {h.hexdigest()} != published {r.sha256}")
            part.unlink(missing_ok=True)
            continue
        os.replace(part, target)
        return []
    return failures


def download(name: str, root: str | Path, *, timeout: float = 60.0,
             urlopen: Optional[UrlOpen] = None) -> Path:
    """Fetch data set ``name``'s files (:data:`RESOURCES`) into ``root / DEST[name]``, verify, extract.

    A file already present with the right digest is not fetched again.

    Args:
        name: one of :data:`~robustagg.data.folders.DATASETS`. root: the data root.
        timeout: seconds per connection attempt. urlopen: ``urllib.request.urlopen`` (tests pass a fake).

    Returns:
        The folder the files were written into.

    Raises:
        ConfigError: unknown ``name``.
        MissingDataError: no mirror could be reached; the message lists each attempt and
            :func:`missing_message`.
        DataFileError: a mirror delivered bytes with another digest (and no other mirror the
            right ones), or an archive member was refused.
    """
    check_name(name)
    opener: UrlOpen = urlopen if urlopen is not None else urllib.request.urlopen
    base = Path(root).expanduser()
    dest = base / DEST[name] if DEST[name] else base
    dest.mkdir(parents=True, exist_ok=True)
    for r in RESOURCES[name]:
        target = dest / r.filename
        if not (target.is_file() and sha256_of(target) == r.sha256):
            failures = _fetch(r, target, timeout=timeout, urlopen=opener)
            if failures:
                text = "\n".join(f"  {f}" for f in failures)
                if all("sha256" in f for f in failures):
                    raise DataFileError(f"every mirror of {r.filename} delivered other bytes than published:\n{text}")
                raise MissingDataError(f"could not download {r.filename}:\n{text}\n{missing_message(name, base)}")
        if r.members_under is not None:
            lay = next(lay for lay in LAYOUTS[name] if lay.folder == r.members_under)
            if not all((base / r.members_under / f).is_file() for f in lay.files):
                safe_extract(target, base, members_under=r.members_under)
    return dest
