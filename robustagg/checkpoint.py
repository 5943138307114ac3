"""Committed checkpoints: two-phase writes, a manifest written last, verified restore, lineage.

Layout under ``root``::

    root/step-00000040/            a committed checkpoint (renamed from step-00000040.tmp/)
        replicated.pt              state every rank shares (rank 0 writes it)
        rank-0.pt ... rank-<w-1>.pt  per-rank state (RNG, data position, momentum)
        manifest.json              written last: format, run id, step, world, roles, hashes, lineage
    root/LATEST                    the name of the newest committed checkpoint (atomic replace)
    root/lineage.jsonl             one record per restore or shrink (from, replayed steps, why)
    root/faults.jsonl              faults fired so far (fault injection fires each one once per run)
    root/step-00000048.rejected-1/ a newer checkpoint set aside on restore (it failed verification)

A checkpoint is **committed** iff its manifest exists and every file it lists has the recorded
size and SHA-256. Everything newer is ignored on restore; a damaged one is skipped in favour of the
previous committed one, with the reason. Files are written to a temp name, fsynced, renamed.

Files hold plain containers (dict, list, tuple, str, int, float, bool, None, tensors) saved with
``torch.save`` and read with ``torch.load(weights_only=True)``: reading a checkpoint never executes
pickled code (a file that needs it is refused with :class:`~robustagg.errors.CheckpointError`).
The directory must be visible to every rank (one machine, or a shared file system).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .errors import CheckpointError

__all__ = ["FORMAT_VERSION", "atomic_write_bytes", "atomic_write_json", "save_state", "load_state", "sha256_file",
           "append_jsonl", "read_jsonl", "Checkpoint", "CheckpointStore"]

FORMAT_VERSION = 1
_COMMITTED = re.compile(r"^step-\d{8}$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, rename (never half-written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``json.dumps(obj, indent=1, sort_keys=True)``."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def save_state(path: Path, state: Any) -> None:
    """Atomically ``torch.save`` a plain container of tensors and primitives to ``path``."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_state(path: Path) -> Any:
    """Load a file written by :func:`save_state` with ``weights_only=True`` (no arbitrary code).

    Raises:
        CheckpointError: the file is missing, truncated, or holds objects that would need code
            execution to rebuild.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing.") from None
    except Exception as exc:  # pickle errors, UnpicklingError from the weights-only unpickler, EOF
        raise CheckpointError(f"refusing to load {path}: {type(exc).__name__}: {str(exc)[:300]}") from None


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line to ``path`` (created if missing) and fsync it.

    A line is appended with one ``write`` call on a file opened for appending, so concurrent
    appenders on one machine do not interleave within a line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` (``[]`` when it does not exist; a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Checkpoint:
    """A committed checkpoint on disk: its folder and parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        """The number of completed optimizer steps the checkpoint holds."""
        return int(self.manifest["step"])

    def file(self, name: str) -> Path:
        """Path of one listed file.

        Raises:
            CheckpointError: ``name`` is not in the manifest.
        """
        if name not in self.manifest["files"]:
            raise CheckpointError(f"{self.path.name} has no file {name!r}; it lists {sorted(self.manifest['files'])}.")
        return self.path / name

    def load(self, name: str) -> Any:
        """:func:`load_state` of one listed file."""
        return load_state(self.file(name))


@dataclass
class CheckpointStore:
    """Writes and finds committed checkpoints under ``root`` (see the module docstring).

    Args:
        root: the checkpoint folder (created if missing).
        keep: committed checkpoints kept; older ones are pruned only after a newer one commits.

    Call order (every rank, per checkpoint): :meth:`staging` -> write own files with
    :func:`save_state` -> barrier (the trainer's) -> rank 0 :meth:`commit` -> barrier.
    """

    root: Path
    keep: int = 3
    _verified: dict[str, bool] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.keep < 1:
            raise CheckpointError(f"keep must be >= 1 (checkpoints to keep); got {self.keep}.")
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(step: int) -> str:
        """Folder name of the checkpoint after ``step`` completed steps."""
        return f"step-{step:08d}"

    def staging(self, step: int) -> Path:
        """The temp folder ``step-N.tmp/`` every rank writes its files into (created, idempotent)."""
        path = self.root / (self.name(step) + ".tmp")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, step: int, meta: dict[str, Any], expected_files: list[str],
               before_rename: Optional[Callable[[Path], None]] = None) -> Checkpoint:
        """Phase two (rank 0, after a barrier): hash the files, write the manifest last, rename, LATEST.

        Args:
            step: completed optimizer steps.
            meta: manifest fields (run id, world size, roles, config hash, code revision, parent,
                restart count, replayed ranges...).
            expected_files: every file the staging folder must hold.
            before_rename: called with the staging folder after the manifest is written and before
                the rename that commits it (fault injection: a crash here leaves it uncommitted).

        Raises:
            CheckpointError: a listed file is missing from the staging folder.
        """
        staging = self.staging(step)
        missing = [f for f in expected_files if not (staging / f).is_file()]
        if missing:
            raise CheckpointError(f"cannot commit step {step}: files {missing} were not written by every rank.")
        files = {f: {"size": (staging / f).stat().st_size, "sha256": sha256_file(staging / f)} for f in expected_files}
        manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files, "committed_at": time.time(), **meta}
        atomic_write_json(staging / "manifest.json", manifest)
        if before_rename is not None:
            before_rename(staging)
        final = self.root / self.name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(self.root)
        atomic_write_bytes(self.root / "LATEST", (self.name(step) + "\n").encode())
        self._prune()
        return Checkpoint(final, manifest)

    def _committed_dirs(self) -> list[Path]:
        return sorted((p for p in self.root.glob("step-*") if p.is_dir() and _COMMITTED.match(p.name)),
                      key=lambda p: p.name, reverse=True)

    def candidates(self) -> list[Path]:
        """Folders that may hold a committed checkpoint, newest first (not yet verified)."""
        return self._committed_dirs()

    def clean_staging(self) -> list[str]:
        """Remove every uncommitted ``step-N.tmp/`` folder (left by a crash mid-write); their names."""
        gone = []
        for p in sorted(self.root.glob("step-*.tmp")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def reject(self, path: Path) -> Path:
        """Set a checkpoint folder aside as ``<name>.rejected-<k>`` (kept for inspection, never a candidate)."""
        path = Path(path)
        k = 1
        while (dest := path.with_name(f"{path.name}.rejected-{k}")).exists():
            k += 1
        os.replace(path, dest)
        _fsync_dir(self.root)
        return dest

    def set_latest(self, name: str) -> None:
        """Point ``LATEST`` at ``name`` (atomic replace)."""
        atomic_write_bytes(self.root / "LATEST", (name + "\n").encode())

    def _prune(self) -> None:
        for old in self._committed_dirs()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def verify(self, path: Path, names: Optional[list[str]] = None) -> list[str]:
        """Problems that keep ``path`` from being a committed checkpoint (empty list: it verifies).

        Args:
            path: the checkpoint folder.
            names: check only these listed files (a rank verifying its own files); a name the
                manifest does not list is a problem. ``None``: every listed file.
        """
        mpath = Path(path) / "manifest.json"
        if not mpath.is_file():
            return [f"{Path(path).name}: no manifest (never committed)"]
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return [f"{Path(path).name}: unreadable manifest ({exc})"]
        if manifest.get("format_version") != FORMAT_VERSION:
            return [f"{Path(path).name}: format {manifest.get('format_version')} != {FORMAT_VERSION}"]
        problems = []
        listed = manifest.get("files", {})
        wanted = list(listed) if names is None else list(names)
        for name in wanted:
            if name not in listed:
                problems.append(f"{Path(path).name}/{name}: not in the manifest")
                continue
            info = listed[name]
            f = Path(path) / name
            if not f.is_file():
                problems.append(f"{Path(path).name}/{name}: missing")
            elif f.stat().st_size != info["size"]:
                problems.append(f"{Path(path).name}/{name}: size {f.stat().st_size} != {info['size']}")
            elif sha256_file(f) != info["sha256"]:
                problems.append(f"{Path(path).name}/{name}: SHA-256 mismatch")
        return problems

    def latest(self) -> tuple[Optional[Checkpoint], list[str]]:
        """The newest checkpoint that verifies, and why each newer candidate was skipped.

        Uncommitted ``.tmp`` folders are never candidates.
        """
        skipped: list[str] = []
        for path in self._committed_dirs():
            problems = self.verify(path)
            if problems:
                skipped.extend(problems)
                continue
            return Checkpoint(path, json.loads((path / "manifest.json").read_text())), skipped
        return None, skipped

    def open(self, path: Path) -> Checkpoint:
        """A specific checkpoint folder, verified.

        Raises:
            CheckpointError: it does not verify (the message lists every problem).
        """
        problems = self.verify(Path(path))
        if problems:
            raise CheckpointError(f"checkpoint {path} does not verify: {'; '.join(problems)}")
        return Checkpoint(Path(path), json.loads((Path(path) / "manifest.json").read_text()))

    def append_lineage(self, record: dict[str, Any]) -> None:
        """Append one JSON line to ``lineage.jsonl`` (fsynced)."""
        append_jsonl(self.root / "lineage.jsonl", record)

    def lineage(self) -> list[dict[str, Any]]:
        """Every lineage record so far (oldest first)."""
        return read_jsonl(self.root / "lineage.jsonl")
