"""Check that a data set's published files are on this machine and are the published content.

    python -m experiments.data_files fashion_mnist              # the folder make data installs into
    python -m experiments.data_files mnist --root DIR

Exit 0 with one line naming the folder when every file loads (MNIST-like files verified against
:data:`robustagg.data.CONTENT` after decompression); exit 2 with what to do otherwise: which
files to place where, ``make data`` (Debian's ``dataset-fashion-mnist``), or
``data.download=true`` where a network exists. ``make data`` runs it after installing.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path
from typing import Optional, Sequence

from robustagg.data import CONTENT, DATASETS, IDX_FILES, load, resolve, system_root
from robustagg.data.folders import find_file
from robustagg.data.digests import claims_published
from robustagg.errors import DataFileError, MissingDataError


def check(name: str, root: Optional[str] = None) -> str:
    """Load data set ``name`` from ``root`` (``None``: the system package's folder) and describe it.

    Raises:
        MissingDataError: files absent (the message says how to get them).
        DataFileError: a file is corrupt, truncated, or not the published content (both digests).
    """
    folder = root if root is not None else system_root(name)
    d = load(name, root)
    verified = ""
    if name in CONTENT:
        unchecked = not_published(name, resolve(name, folder)[0]) if folder is not None else []
        verified = (" (decompressed content verified against the published SHA-256)" if not unchecked else
                    f"; NOT verified: {', '.join(unchecked)} (headers declaring dimensions no published {name} file "
                    "has: nothing to compare with)")
    return (f"{name}: {len(d.train_y)} training and {len(d.test_y)} test examples of {d.input_shape}, "
            f"{d.num_classes} classes, read from {folder}{verified}.")


def not_published(name: str, folder: Path) -> list[str]:
    """The IDX files of data set ``name`` in ``folder`` whose headers declare dimensions other than
    the published file's of their name (read without a digest check: :mod:`robustagg.data.digests`).
    A data set without published digests (CIFAR) has every file listed.
    """
    out = []
    for f in IDX_FILES:
        path = find_file(folder, f, "idx")
        if path is None:
            continue
        with open(path, "rb") as fh:
            gzipped = fh.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as fh:
            head = fh.read(16)
        if not claims_published(name, f, head):
            out.append(path.name)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: print :func:`check`'s line (exit 0) or the reason and the fix (exit 2)."""
    p = argparse.ArgumentParser(prog="python -m experiments.data_files", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=DATASETS)
    p.add_argument("--root", default=None, help="the data root (default: where a system package installed it)")
    a = p.parse_args(argv)
    try:
        print(check(a.name, a.root))
    except (MissingDataError, DataFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
