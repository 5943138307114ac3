"""Reading a data file's bytes, gzipped or not, with errors that name the file."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from ..errors import DataFileError, MissingDataError

__all__ = ["read_bytes"]

_GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | Path) -> bytes:
    """The content of ``path``; a gzip file (recognised by its magic bytes, not its name) is
    decompressed.

    Raises:
        MissingDataError: the file does not exist.
        DataFileError: the file cannot be read (permissions, an I/O error), or a gzip stream is
            truncated or corrupt (the message names the file).
    """
    p = Path(path)
    if not p.is_file():
        raise MissingDataError(f"data file {p} does not exist.")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataFileError(f"data file {p} cannot be read ({e.strerror or e}); fix its permissions or replace it.") \
            from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise DataFileError(f"{p} is a truncated or corrupt gzip file ({len(raw)} bytes on disk: {e}); "
                            "download it again or place an uncompressed copy next to it.") from e
