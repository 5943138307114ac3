"""Run files written whole or not at all: temp file in the same folder, fsync, rename."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from torch import nn

__all__ = ["atomic_write", "write_json", "save_model"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then fsync and rename the temp file onto ``path``.

    A reader sees either the old file or the complete new one, never a half-written file.

    Args:
        path: the destination (its folder is created).
        write: writes the whole content to the temp path it is given.

    Returns:
        ``Path(path)``.

    Raises:
        StorageError: the folder cannot be written (read-only, full disk), naming ``path``.
    """
    from ..checkpoint import storage_errors

    dest = Path(path)
    with storage_errors(dest):
        return _atomic_write(dest, write)


def _atomic_write(dest: Path, write: Callable[[str], None]) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; run files get the usual permissions
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
        dfd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON atomically (NaN -> null, inf -> "inf")."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(_clean(obj), fh, indent=2, sort_keys=True, allow_nan=False)
            fh.write("\n")

    return atomic_write(path, write)


def save_model(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Save ``model.state_dict()`` as safetensors atomically (names as in the state dict).

    Tensors are copied to contiguous CPU memory; tensors that share storage are saved as copies.
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp))
