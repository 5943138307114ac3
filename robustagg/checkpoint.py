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

The folder is untrusted input. Every name a manifest mentions (``files``, ``hosts``) must be a
plain file name (:func:`check_name`: no path separator, no ``..``, not absolute) of a regular file
directly inside the step folder; symbolic links (files, ``manifest.json``, step folders) are
refused, and nothing outside the folder is ever opened: a violation is a verification problem, so
the checkpoint is rejected with the reason like any other damage. A file is hashed and parsed from
the same bytes (:meth:`Checkpoint.load`), so it cannot change between the check and the use.

What the digests prove: the SHA-256 of every file in the manifest detects *accidents* (a torn or
bit-flipped file, a file from another checkpoint copied in by mistake). They do not authenticate:
whoever can write the folder can rewrite a file and its digest together. With a key
(``CheckpointStore(root, key=...)`` or the environment variable :data:`KEY_ENV`) the manifest also
carries an HMAC-SHA256 over its canonical JSON (:func:`manifest_mac`); since the manifest holds
every file's digest, that authenticates every file, and a store with a key refuses a manifest
without a valid HMAC. Even then nothing stops that writer from deleting the newest checkpoints
(a rollback to an older, validly signed one).

Files hold plain containers (dict, list, tuple, str, int, float, bool, None, tensors) saved with
``torch.save`` and read with ``torch.load(weights_only=True)``: reading a checkpoint never executes
pickled code (a file that needs it is refused with :class:`~robustagg.errors.CheckpointError`).
The directory must be visible to every rank (one machine, or a shared file system).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from .errors import CheckpointError, StorageError

__all__ = ["FORMAT_VERSION", "KEY_ENV", "STORAGE_ERRNOS", "storage_errors", "open_for_writing", "atomic_write_bytes", "atomic_write_json", "read_regular", "save_state", "load_state",
           "parse_state", "parse_manifest", "sha256_bytes", "sha256_file", "append_jsonl", "read_jsonl", "check_name", "manifest_mac", "Checkpoint",
           "CheckpointStore"]

#: 2: files written by the trainer's Checkpointer carry their own identity (step, run id, workers).
FORMAT_VERSION = 2
#: Environment variable holding the HMAC key (UTF-8 text) a :class:`CheckpointStore` uses when
#: none is passed; unset or empty: no key (digests detect accidents only).
KEY_ENV = "ROBUSTAGG_CHECKPOINT_KEY"
MANIFEST = "manifest.json"
_COMMITTED = re.compile(r"step-[0-9]{8}", re.ASCII)  # used with fullmatch: no trailing newline, ASCII digits only
#: What a candidate looks like (any Unicode digit, as ``\d`` matches): such a folder that is not
#: :data:`_COMMITTED` is a candidate that verify rejects with the reason, not a silent stray.
_LOOKS_COMMITTED = re.compile(r"step-\d{8}")
_STEP_IN_NAME = re.compile(r"step-([0-9]{8})(?:\.rejected-[0-9]+)?", re.ASCII)
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
#: The largest ``manifest.json`` read (bytes): a bigger one is rejected unread.
MAX_MANIFEST_BYTES = 16 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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


#: ``errno`` values that mean "this storage cannot take the write" (not a bug of the caller).
STORAGE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EIO",
                                                        "EFBIG") if hasattr(errno, n))


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an ``OSError`` of the storage (:data:`STORAGE_ERRNOS`) raised inside into a
    :class:`~robustagg.errors.StorageError` whose one-line message names ``path`` and the cause.

    A write to a full disk raises ``OSError(ENOSPC)`` with no file name; this names the file.

    Example:
        >>> import errno
        >>> with storage_errors("/runs/x/metrics.jsonl"):  # doctest: +ELLIPSIS
        ...     raise OSError(errno.ENOSPC, "No space left on device")
        Traceback (most recent call last):
        ...
        robustagg.errors.StorageError: cannot write /runs/x/metrics.jsonl: No space left on device (ENOSPC); ...
    """
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise StorageError(f"cannot write {path}: {exc.strerror} ({code}); every file committed before is intact: "
                           f"free space or make the folder writable, then run the same command again to resume",
                           exc.errno) from None


def open_for_writing(path: Path, *, append: bool = False) -> int:
    """Open ``path`` for writing without following a symbolic link: the one way a run file is opened.

    A symbolic link planted at ``path`` is removed first (its target is left alone) and a regular
    file created in its place; ``O_NOFOLLOW`` then refuses a link planted in between, and the
    open is retried. Every file the run writes goes through here: whole files through
    :func:`atomic_write_bytes` (its temp file), appended logs (``lineage.jsonl``, ``faults.jsonl``,
    ``detections.jsonl``) through :func:`append_jsonl`, ``metrics.jsonl`` through
    :class:`~robustagg.training.JsonlSink`, the run lock's files.

    Args:
        path: the file. append: ``O_APPEND`` (keep what it holds) instead of ``O_TRUNC``.

    Returns:
        a file descriptor open for writing (the caller closes it, e.g. with :func:`os.fdopen`).

    Raises:
        StorageError: the folder cannot be written (read-only, full disk; :func:`storage_errors`).
        OSError: the path exists and is not a regular file (a folder, a FIFO).
    """
    with storage_errors(path):
        return _open_for_writing(path, append)


def _open_for_writing(path: Path, append: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_NONBLOCK", 0)
    for _ in range(100):
        if os.path.islink(path):  # never write through a link someone planted at the name
            os.unlink(path)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue  # a link appeared between the check and the open: remove it again
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return fd
    raise OSError(errno.ELOOP, "a symbolic link keeps being planted at this name", str(path))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, rename (never half-written;
    never through a symbolic link, :func:`open_for_writing`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with storage_errors(path):
        fd = open_for_writing(tmp)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk leaves no partial temp file behind
            raise
        _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``json.dumps(obj, indent=1, sort_keys=True)``."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def save_state(path: Path, state: Any) -> None:
    """Atomically ``torch.save`` a plain container of tensors and primitives to ``path``."""
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


def parse_state(data: bytes, where: str) -> Any:
    """Parse the bytes of a file written by :func:`save_state` (``weights_only=True``; ``where`` names it in errors).

    Raises:
        CheckpointError: the bytes do not parse, or would need code execution to rebuild.
    """
    return _load_bytes(data, where)


def _load_bytes(data: bytes, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # as load_state
        raise CheckpointError(f"refusing to load {where}: {type(exc).__name__}: {str(exc)[:300]}") from None


def check_name(name: Any) -> Optional[str]:
    """Why ``name`` is not a plain file name a manifest may list (``None``: it is one).

    A plain name is 1-128 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit: no
    path separator, no ``..``, not absolute, not hidden, so it can only name an entry directly
    inside the checkpoint folder.

    Example:
        >>> check_name("rank-1.pt") is None, check_name("../../etc/passwd") is not None
        (True, True)
    """
    if isinstance(name, str) and _PLAIN.fullmatch(name):
        return None
    return (f"{name!r} is not a plain file name inside the checkpoint folder (no path separators, "
            "no '..', not absolute)")


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object a ``manifest.json`` holds (untrusted bytes; ``where`` names it in errors).

    Raises:
        CheckpointError: not UTF-8, not JSON, nested too deeply to parse (a crafted
            ``[[[[...]]]]``), or not a JSON object.
    """
    try:
        manifest = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: unreadable manifest ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: unreadable manifest (nested too deeply to parse)") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: unreadable manifest (not a JSON object)")
    return manifest


def read_regular(folder: Path, name: str, size: Optional[int] = None, limit: Optional[int] = None) -> bytes:
    """The bytes of ``folder/name``, a regular file directly inside ``folder`` (no symlink followed).

    The one way this package reads a file from an untrusted folder (a checkpoint, a run's evidence).

    Args:
        size: the size the manifest records: a file of another size is refused before a byte is
            read (a crafted 1 TiB sparse file is never loaded into memory).
        limit: the largest size read when no ``size`` is known (the manifest itself).

    Raises:
        CheckpointError: the name is not plain, the entry is missing, a symlink, not a regular
            file, resolves outside ``folder``, or has another size than ``size`` (or above ``limit``).
    """
    where = f"{folder.name}/{name}"
    why = check_name(name)
    if why is not None:
        raise CheckpointError(f"{folder.name}: {why}")
    path = folder / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{where}: is a symbolic link (refused: only regular files inside the folder are read)")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{where}: not a regular file")
    if path.resolve().parent != folder.resolve():
        raise CheckpointError(f"{where}: resolves outside the checkpoint folder")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: not a regular file")
        if size is not None and st.st_size != size:
            raise CheckpointError(f"{where}: size {st.st_size} != {size}")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{where}: {st.st_size} bytes, more than the {limit} a {name} may have")
        data = fh.read(st.st_size + 1)
        if size is not None and len(data) != size:  # changed while being read
            raise CheckpointError(f"{where}: size {len(data)} != {size}")
        return data


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    body = json.loads(json.dumps(body))  # the form it has after a round trip through the file
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_mac(manifest: dict[str, Any], key: bytes) -> str:
    """Hex HMAC-SHA256 (RFC 2104 with SHA-256) of a manifest's canonical JSON, its ``hmac`` field left out.

    Canonical JSON: ``json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True)``
    of the manifest as it reads back from its file (tuples become lists).

    Raises:
        CheckpointError: ``key`` is not non-empty bytes.
    """
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise CheckpointError(f"the checkpoint key must be non-empty bytes; got {type(key).__name__}.")
    return hmac.new(bytes(key), _canonical(manifest), hashlib.sha256).hexdigest()


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line to ``path`` (created if missing) and fsync it.

    A line is appended with one ``write`` call on a file opened for appending, so concurrent
    appenders on one machine do not interleave within a line. The file is opened without following
    a symbolic link (:func:`open_for_writing`): a link planted at ``path`` is replaced by a regular
    file, its target left alone.
    """
    path = Path(path)
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(open_for_writing(path, append=True), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` (``[]`` when it does not exist; a torn or unparseable line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError):  # torn, or nested too deeply to parse
            continue
    return out


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data`` (the digest a manifest records for each file and a peer's state message)."""
    return hashlib.sha256(data).hexdigest()


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
        """Path of one listed file (a plain name directly inside the folder).

        Raises:
            CheckpointError: ``name`` is not in the manifest or not a plain file name.
        """
        if name not in self.manifest["files"]:
            raise CheckpointError(f"{self.path.name} has no file {name!r}; it lists {sorted(self.manifest['files'])}.")
        why = check_name(name)
        if why is not None:
            raise CheckpointError(f"{self.path.name}: {why}")
        return self.path / name

    def load(self, name: str) -> Any:
        """Read one listed file once, check its size and SHA-256 against the manifest, then parse
        those same bytes with ``torch.load(weights_only=True)`` (no pickled code runs).

        Raises:
            CheckpointError: not listed, not a plain name, missing, a symlink, size or SHA-256
                differ, or the content needs code execution (or is not a torch file).
        """
        return _load_bytes(self.read_bytes(name), f"{self.path.name}/{name}")

    def read_bytes(self, name: str) -> bytes:
        """The bytes of one listed file, read once, after checking their size and SHA-256 against
        the manifest (not parsed: what a peer keeps in memory, :mod:`robustagg.launch.peer`).

        Raises:
            CheckpointError: as :meth:`load`, except the parsing.
        """
        self.file(name)
        info = self.manifest["files"][name]
        if not isinstance(info, dict) or not isinstance(info.get("size"), int):
            raise CheckpointError(f"{self.path.name}/{name}: the manifest records no int size")
        data = read_regular(self.path, name, size=info["size"])
        if len(data) != info.get("size"):
            raise CheckpointError(f"{self.path.name}/{name}: size {len(data)} != {_get(info, 'size')}")
        if sha256_bytes(data) != info.get("sha256"):
            raise CheckpointError(f"{self.path.name}/{name}: SHA-256 mismatch")
        return data


def _get(info: Any, key: str) -> Any:
    return info.get(key) if isinstance(info, dict) else None


def _key_from_env() -> Optional[bytes]:
    text = os.environ.get(KEY_ENV, "")
    return text.encode() if text else None


@dataclass
class CheckpointStore:
    """Writes and finds committed checkpoints under ``root`` (see the module docstring).

    Args:
        root: the checkpoint folder (created if missing).
        keep: committed checkpoints kept; older ones are pruned only after a newer one commits.
        key: HMAC key (bytes): :meth:`commit` signs each manifest (field ``hmac``, HMAC-SHA256 of
            its canonical JSON, :func:`manifest_mac`) and :meth:`verify` refuses a manifest whose
            HMAC is missing or wrong. ``None`` (default): the UTF-8 bytes of the environment
            variable :data:`KEY_ENV` when it is set and non-empty, else no key (manifests are not
            signed, and an existing ``hmac`` field is not checked). ``b""``: no key, whatever the
            environment says. Every rank must use the same key.

    Raises:
        CheckpointError: ``keep < 1``, or ``key`` is not bytes.

    Call order (every rank, per checkpoint): :meth:`staging` -> write own files with
    :func:`save_state` -> barrier (the trainer's) -> rank 0 :meth:`commit` -> barrier.
    """

    root: Path
    keep: int = 3
    key: Optional[bytes] = field(default=None, repr=False)
    _verified: dict[str, bool] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.keep < 1:
            raise CheckpointError(f"keep must be >= 1 (checkpoints to keep); got {self.keep}.")
        if self.key is None:
            self.key = _key_from_env()
        elif not isinstance(self.key, (bytes, bytearray)):
            raise CheckpointError(f"key must be bytes (the HMAC key) or None; got {type(self.key).__name__}. "
                                  f"Pass e.g. key=os.environ[{KEY_ENV!r}].encode().")
        else:
            self.key = bytes(self.key) or None  # b"": explicitly no key
        with storage_errors(self.root):
            self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(step: int) -> str:
        """Folder name of the checkpoint after ``step`` completed steps."""
        return f"step-{step:08d}"

    def staging(self, step: int) -> Path:
        """The temp folder ``step-N.tmp/`` every rank writes its files into (created, idempotent;
        a symbolic link planted at that name is removed first, never written through)."""
        path = self.root / (self.name(step) + ".tmp")
        with storage_errors(path):
            if path.is_symlink():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, step: int, meta: dict[str, Any], expected_files: list[str],
               before_rename: Optional[Callable[[Path], None]] = None) -> Checkpoint:
        """Phase two (rank 0, after a barrier): hash the files, write the manifest last, rename, LATEST.

        Args:
            step: completed optimizer steps.
            meta: manifest fields (run id, world size, roles, config hash, code revision, parent,
                restart count, replayed ranges...).
            expected_files: every file the staging folder must hold (plain names, :func:`check_name`).
            before_rename: called with the staging folder after the manifest is written and before
                the rename that commits it (fault injection: a crash here leaves it uncommitted).

        Raises:
            CheckpointError: a listed name is not a plain file name, or a listed file is missing
                from the staging folder.
        """
        bad = [why for f in expected_files if (why := check_name(f)) is not None]
        if bad:
            raise CheckpointError(f"cannot commit step {step}: {'; '.join(bad)}.")
        staging = self.staging(step)
        missing = [f for f in expected_files if not (staging / f).is_file() or (staging / f).is_symlink()]
        if missing:
            raise CheckpointError(f"cannot commit step {step}: files {missing} were not written by every rank.")
        files = {}
        for f in expected_files:
            data = read_regular(staging, f)
            files[f] = {"size": len(data), "sha256": sha256_bytes(data)}
        manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files, "committed_at": time.time(), **meta}
        manifest.pop("hmac", None)
        if self.key:
            manifest["hmac"] = manifest_mac(manifest, self.key)
        atomic_write_json(staging / MANIFEST, manifest)
        if before_rename is not None:
            before_rename(staging)
        final = self.root / self.name(step)
        if final.is_symlink():
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        with storage_errors(final):
            os.replace(staging, final)
        _fsync_dir(self.root)
        atomic_write_bytes(self.root / "LATEST", (self.name(step) + "\n").encode())
        self._prune()
        return Checkpoint(final, json.loads(json.dumps(manifest)))

    def _committed_dirs(self) -> list[Path]:
        # symlinks and names with non-ASCII digits are candidates too, so that verify refuses them
        # with a reason and restore sets them aside
        found = (p for p in self.root.glob("step-*")
                 if _LOOKS_COMMITTED.fullmatch(p.name) and (p.is_dir() or p.is_symlink()))
        return sorted(found, key=lambda p: p.name, reverse=True)

    def candidates(self) -> list[Path]:
        """Folders that may hold a committed checkpoint, newest first (not yet verified)."""
        return self._committed_dirs()

    def rejected(self) -> list[Path]:
        """Checkpoint folders set aside by :meth:`reject` (``step-N.rejected-k``), newest first."""
        found = (p for p in self.root.glob("step-*.rejected-*") if _STEP_IN_NAME.fullmatch(p.name))
        return sorted(found, key=lambda p: p.name, reverse=True)

    def clean_staging(self) -> list[str]:
        """Remove every uncommitted ``step-N.tmp/`` folder (left by a crash mid-write); their names.

        A symbolic link at such a name is unlinked (its target is left alone)."""
        gone = []
        for p in sorted(self.root.glob("step-*.tmp")):
            if p.is_symlink():
                p.unlink()
                gone.append(p.name)
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def reject(self, path: Path) -> Path:
        """Set a checkpoint folder aside as ``<name>.rejected-<k>`` (kept for inspection, never a candidate).

        A symbolic link is renamed itself; its target is not touched."""
        path = Path(path)
        k = 1
        while (dest := path.with_name(f"{path.name}.rejected-{k}")).exists() or dest.is_symlink():
            k += 1
        os.replace(path, dest)
        _fsync_dir(self.root)
        return dest

    def set_latest(self, name: str) -> None:
        """Point ``LATEST`` at ``name`` (atomic replace).

        Raises:
            CheckpointError: ``name`` is not a committed folder name (``step-NNNNNNNN``).
        """
        if not _COMMITTED.fullmatch(name):
            raise CheckpointError(f"LATEST must name a committed folder step-NNNNNNNN; got {name!r}.")
        atomic_write_bytes(self.root / "LATEST", (name + "\n").encode())

    def latest_name(self) -> Optional[str]:
        """The folder ``LATEST`` names, or ``None`` when it is missing, not a committed name
        (``step-NNNNNNNN``), a symbolic link itself, or names a symbolic link or no folder.

        ``LATEST`` is a hint for people and tools; :meth:`latest` and the restore never trust it.
        """
        path = self.root / "LATEST"
        if path.is_symlink() or not path.is_file():
            return None
        name = path.read_text(errors="replace").strip()
        target = self.root / name
        if not _COMMITTED.fullmatch(name) or target.is_symlink() or not target.is_dir():
            return None
        return name

    def _prune(self) -> None:
        for old in self._committed_dirs()[self.keep:]:
            if old.is_symlink():
                old.unlink()  # never follow a link out of the folder
            else:
                shutil.rmtree(old, ignore_errors=True)

    def read_manifest(self, path: Path) -> dict[str, Any]:
        """The parsed ``manifest.json`` of a checkpoint folder (not verified; see :meth:`verify`).

        Raises:
            CheckpointError: the folder is a symbolic link, or the manifest is missing, a symbolic
                link, not a JSON object, or unreadable.
        """
        path = Path(path)
        if path.is_symlink():
            raise CheckpointError(f"{path.name}: the step folder is a symbolic link (refused: it may point outside "
                                  "the checkpoint folder)")
        if not path.is_dir():
            raise CheckpointError(f"{path.name}: not a folder")
        try:
            data = read_regular(path, MANIFEST, limit=MAX_MANIFEST_BYTES)
        except CheckpointError as exc:
            if str(exc).endswith(": missing"):
                raise CheckpointError(f"{path.name}: no manifest (never committed)") from None
            raise
        return parse_manifest(data, path.name)

    def _manifest_problems(self, path: Path, manifest: dict[str, Any]) -> list[str]:
        where = path.name
        if _LOOKS_COMMITTED.fullmatch(where) and not _COMMITTED.fullmatch(where):
            return [f"{where}: the folder name is not step- followed by 8 ASCII digits (0-9)"]
        if manifest.get("format_version") != FORMAT_VERSION:
            return [f"{where}: format {manifest.get('format_version')} != {FORMAT_VERSION}"]
        if self.key:
            mac = manifest.get("hmac")
            if not isinstance(mac, str):
                return [f"{where}: the manifest has no HMAC, and this store has a key (written without it, or forged)"]
            if not hmac.compare_digest(mac, manifest_mac(manifest, self.key)):
                return [f"{where}: manifest HMAC mismatch (edited, or signed with another key)"]
        problems = []
        step = manifest.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.append(f"{where}: manifest step {step!r} is not a non-negative int")
        elif (m := _STEP_IN_NAME.fullmatch(where)) and int(m.group(1)) != step:
            problems.append(f"{where}: the manifest says step {step}, the folder name says {int(m.group(1))}")
        files = manifest.get("files")
        if not isinstance(files, dict):
            return problems + [f"{where}: manifest 'files' is not an object"]
        for name, info in files.items():
            why = check_name(name)
            if why is not None:
                problems.append(f"{where}: manifest file {why}")
            elif not (isinstance(info, dict) and isinstance(info.get("size"), int)
                      and isinstance(info.get("sha256"), str)):
                problems.append(f"{where}/{name}: manifest entry needs an int size and a sha256 string")
        hosts = manifest.get("hosts", {})
        if not isinstance(hosts, dict):
            return problems + [f"{where}: manifest 'hosts' is not an object"]
        for name, ids in hosts.items():
            why = check_name(name)
            if why is not None:
                problems.append(f"{where}: manifest hosts entry {why}")
            elif name not in files:
                problems.append(f"{where}: hosts names {name!r}, which the manifest does not list")
            elif not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                problems.append(f"{where}: hosts[{name!r}] is not a list of worker ids")
        return problems

    def verify(self, path: Path, names: Optional[list[str]] = None) -> list[str]:
        """Problems that keep ``path`` from being a committed checkpoint (empty list: it verifies).

        Checks, in order: the folder and ``manifest.json`` are not symbolic links; the manifest
        parses, has this :data:`FORMAT_VERSION` and (with a key) a valid HMAC; its step is an int
        matching the folder name (``step-NNNNNNNN``); every name in ``files`` and ``hosts`` is a
        plain file name (:func:`check_name`), every ``hosts`` name is listed in ``files``; then each
        wanted file is a regular file directly inside the folder (not a symlink) with the
        recorded size and SHA-256. Nothing outside the folder is opened.

        Args:
            path: the checkpoint folder.
            names: check only these listed files (a rank verifying its own files); a name the
                manifest does not list is a problem; ``[]`` checks the manifest alone. ``None``:
                every listed file.
        """
        path = Path(path)
        try:
            manifest = self.read_manifest(path)
        except CheckpointError as exc:
            return [str(exc)]
        problems = self._manifest_problems(path, manifest)
        if problems:
            return problems
        listed = manifest["files"]
        wanted = list(listed) if names is None else list(names)
        for name in wanted:
            if name not in listed:
                problems.append(f"{path.name}/{name}: not in the manifest")
                continue
            try:
                data = read_regular(path, name, size=listed[name]["size"])  # the size first, unread
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            if len(data) != listed[name]["size"]:
                problems.append(f"{path.name}/{name}: size {len(data)} != {listed[name]['size']}")
            elif hashlib.sha256(data).hexdigest() != listed[name]["sha256"]:
                problems.append(f"{path.name}/{name}: SHA-256 mismatch")
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
            return Checkpoint(path, self.read_manifest(path)), skipped
        return None, skipped

    def open(self, path: Path) -> Checkpoint:
        """A specific checkpoint folder, verified.

        Raises:
            CheckpointError: it does not verify (the message lists every problem).
        """
        problems = self.verify(Path(path))
        if problems:
            raise CheckpointError(f"checkpoint {path} does not verify: {'; '.join(problems)}")
        return Checkpoint(Path(path), self.read_manifest(Path(path)))

    def append_lineage(self, record: dict[str, Any]) -> None:
        """Append one JSON line to ``lineage.jsonl`` (fsynced)."""
        append_jsonl(self.root / "lineage.jsonl", record)

    def lineage(self) -> list[dict[str, Any]]:
        """Every lineage record so far (oldest first)."""
        return read_jsonl(self.root / "lineage.jsonl")
