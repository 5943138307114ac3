"""An exclusive lock on a run directory (or a checkpoint folder): one launch at a time, stale locks
detected by PID and host.

The lock is a file ``<folder>/run.lock`` holding the owner's host name, PID and process start time.
It is written whole first (a temp file, fsynced) and then *linked* into place with ``os.link``,
which fails if the name exists: the lock file is never seen empty or half-written, so a second
launcher can never mistake a lock being taken for a stale one. A lock that cannot be read or parsed
(written by hand, or torn by a crash of an older version) counts as *held*: it is read again for a
while, then the launch is refused with the file to delete. A lock whose owner is on this host and
no longer alive (or a different process now has its PID) is stale and is taken over; a lock held by
a live process, or by another host (whose processes cannot be checked from here), refuses the
launch with a message that names the owner and the fix. Taking over a stale lock is serialised by
``fcntl.flock`` on a guard file, so two launches that both find the same stale lock cannot both
take it.

What a lock covers: :func:`~robustagg.launch.launch` locks the run directory and the checkpoint
folder (``trainer.checkpoint.dir``, which may be shared by two run directories), so two launches
can share neither.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

from ..checkpoint import open_for_writing, storage_errors
from ..errors import ConfigError

__all__ = ["RunLock", "RunLockedError", "process_start_time"]

LOCK_NAME = "run.lock"
GUARD_NAME = ".run.lock.guard"
#: Seconds an unreadable lock file is read again before the launch is refused (it never counts as stale).
UNREADABLE_WAIT_S = 2.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class RunLockedError(ConfigError):
    """The run directory is locked by another launch (a :class:`~robustagg.errors.ConfigError`)."""


def process_start_time(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or ``None``."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of stat(5), after "pid (comm)"
    except (IndexError, ValueError):
        return None


def _alive(pid: int, start: Optional[int]) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = process_start_time(pid)
    return start is None or now is None or now == start


class RunLock:
    """Hold ``<run_dir>/run.lock`` for the lifetime of one launch (a context manager).

    Args:
        run_dir: the run directory (created if missing).
        what: a short description of the holder (e.g. the command line), stored in the lock.
        label: what the folder is, for messages (``"run directory"`` or ``"checkpoint folder"``).

    A process that already holds the lock may acquire it again (re-entrant: the inner release
    leaves it held).

    Raises:
        RunLockedError: on :meth:`acquire`, when a live process (on this host) or a process on
            another host holds the lock, or the lock file stays unreadable; the message names
            host, PID, start time and the fix.

    Example:
        >>> import json, tempfile, time
        >>> d = tempfile.mkdtemp()
        >>> with RunLock(d) as lock:
        ...     RunLock(d).acquire().nested  # the same process again: re-entrant
        True
        >>> with open(f"{d}/run.lock", "w") as fh:  # a launch on another host holds it
        ...     json.dump({"host": "elsewhere", "pid": 1, "since": time.time()}, fh)
        >>> RunLock(d).acquire()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        robustagg.launch.lock.RunLockedError: run directory ... is in use by another launch: PID 1 on host 'elsewhere', ...
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, what: str = "", label: str = "run directory") -> None:
        self.dir = Path(run_dir)
        self.label = label
        self.also = "" if label == "run directory" else " and another trainer.checkpoint.dir"
        self.path = self.dir / LOCK_NAME
        self.what = what
        self.held = False
        self.nested = False
        self.took_over: Optional[dict[str, Any]] = None
        self.created = False

    def _owner(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start": process_start_time(pid), "since": time.time(),
                "what": self.what}

    def _create(self) -> bool:
        """Write the owner record whole into a temp file, then link it to ``run.lock`` (fails if taken)."""
        tmp = self.dir / f".{LOCK_NAME}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self._owner(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, self.path, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(tmp)

    def _read(self) -> Optional[dict[str, Any]]:
        """The owner record; ``{}`` when there is no lock; ``None`` when it cannot be read or parsed."""
        try:
            fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError:
            return None  # a symbolic link or an unreadable file: held by someone we cannot name
        try:
            with os.fdopen(fd, "rb") as fh:
                data = json.loads(fh.read(1 << 16).decode())
        except (OSError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) and data else None

    def acquire(self) -> "RunLock":
        """Take the lock (see the module and class docstrings); idempotent for the holder.

        Raises:
            RunLockedError: held by a live process or another host, or unreadable for
                ``UNREADABLE_WAIT_S`` seconds.
        """
        if self.held:
            return self
        deadline = time.monotonic() + UNREADABLE_WAIT_S
        while True:
            if not self.dir.is_dir():
                with storage_errors(self.dir):
                    self.dir.mkdir(parents=True, exist_ok=True)
                self.created = True
            try:
                with storage_errors(self.path):  # a read-only folder or a full disk: one line, the path
                    linked = self._create()
            except FileNotFoundError:
                continue  # another launch removed the empty folder it had created: make it again
            if linked:
                self.held = True
                return self
            with os.fdopen(open_for_writing(self.dir / GUARD_NAME, append=True), "a") as guard:
                fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
                owner = self._read()
                if owner == {}:
                    continue  # released in between: try to link ours again
                if owner is None:
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue  # never stale: read it again, then refuse
                    raise RunLockedError(f"{self.label} {self.dir} is locked by {self.path}, which cannot be read "
                                         f"as a lock record (not written by a launch of this version, or damaged); "
                                         f"it counts as held. If no launch uses this {self.label}, delete "
                                         f"{self.path}.")
                if owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid():
                    self.held, self.nested = True, True  # this process holds it already (re-entrant)
                    return self
                host, pid = owner.get("host"), owner.get("pid")
                if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid, owner.get("start")):
                    try:  # stale: under the guard, only one launch removes it; a new lock is linked, never replaced
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
                    if self._create():
                        self.held, self.took_over = True, owner
                        return self
                    continue  # someone linked a fresh lock in between: read it again
            break
        since = owner.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        where = "this host" if owner.get("host") == socket.gethostname() else f"host {owner.get('host')!r}"
        fix = ("wait for it to finish or stop it (kill it, then run the same command again to resume)"
               if owner.get("host") == socket.gethostname() else
               f"if no process on {owner.get('host')!r} uses this run any more, delete {self.path}")
        raise RunLockedError(f"{self.label} {self.dir} is in use by another launch: PID {owner.get('pid')} on "
                             f"{where}, since {when} ({owner.get('what') or 'no description'}). Two launches on one "
                             f"{self.label} would mix their checkpoints; {fix}, or choose another run directory "
                             f"(run_name=... or hydra.run.dir=...){self.also}.")

    def release(self) -> None:
        """Remove the lock file if this object holds it, and the folder if :meth:`acquire` created it
        and nothing but the lock's own files is left in it."""
        if self.held and not self.nested:
            if (self._read() or {}).get("pid") == os.getpid():
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
            if self.created:
                try:
                    if [p.name for p in self.dir.iterdir()] == [GUARD_NAME]:
                        (self.dir / GUARD_NAME).unlink()
                        self.dir.rmdir()
                except OSError:
                    pass  # someone else is using the folder now: leave it
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()
