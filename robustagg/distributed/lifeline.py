"""What ties a spawned worker to its launcher: it dies with it, stops when asked, and reports progress.

Three mechanisms, each usable on its own (:func:`~robustagg.distributed.spawn` installs all three in
every worker it starts, whatever the start method):

- **Death with the launcher** (:func:`die_with`). On Linux the kernel sends the worker SIGKILL
  when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``). The parent is the launcher for the
  ``fork`` and ``spawn`` start methods, but the *forkserver* for ``forkserver``; so a watchdog
  thread also watches the launcher's pid itself (a pidfd that becomes readable when the process
  exits, or, where pidfds are missing, a poll of the pid every ``poll_seconds``) and kills the
  worker when the launcher is gone. A worker therefore never outlives a SIGKILLed launcher (it
  cannot write checkpoints, summaries or weights for a run the user killed).
- **Stop on request** (:func:`request_stop`, :func:`stop_requested`). A signal handler records the
  signal; the training loop puts it in its next step header, every rank reads every header, and
  all ranks stop after that same step (:func:`~robustagg.training.fit` raises
  :class:`~robustagg.errors.Interrupted` after the final committed checkpoint).
- **Heartbeats** (:class:`Heartbeats`, :func:`mark`, :func:`beat`). A small shared-memory table,
  one row per worker: its phase (started, joining the group, joined, training), its completed
  steps and when it last wrote. The launcher reads it when a group fails, so its report names the
  rank that never joined, or the step a rank that stopped answering was last seen at.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Optional

__all__ = ["die_with", "is_running", "request_stop", "stop_requested", "clear_stop", "Heartbeats", "attach", "mark",
           "beat", "PHASES", "STARTED", "JOINING", "JOINED", "TRAINING"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: Phases a worker reports in its heartbeat row (0: the process has not reached its entry point).
STARTED, JOINING, JOINED, TRAINING = 1, 2, 3, 4
PHASES = {0: "not started", STARTED: "started", JOINING: "joining the group", JOINED: "joined the group",
          TRAINING: "training"}


# --- death with the launcher ---------------------------------------------------------------------
def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; ``False`` where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return False


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie counts as exited).

    Example:
        >>> import os
        >>> is_running(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(pid: int, poll_seconds: float, parent: int) -> None:
    fd: Optional[int] = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            _kill_self()
        except OSError:  # kernel without pidfds
            fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
        _kill_self()
    while is_running(pid) and (parent != pid or os.getppid() == parent):
        time.sleep(poll_seconds)
    _kill_self()


def die_with(launcher_pid: int, *, poll_seconds: float = 0.5) -> list[str]:
    """Make this process die (SIGKILL) as soon as process ``launcher_pid`` exits.

    Call it first thing in a worker. Works for every start method: the parent-death signal covers
    a launcher that is the parent (``fork``, ``spawn``), the watchdog thread covers the
    ``forkserver`` (whose workers are the forkserver's children) and platforms without ``prctl``.
    The parent-death signal fires when the launcher *thread* that started the worker ends, so
    call :func:`~robustagg.distributed.spawn` from a thread that outlives its workers (its
    main thread, typically).

    Args:
        launcher_pid: the pid of the process whose death must end this one (``os.getpid()`` of
            the launcher, taken before it starts the workers).
        poll_seconds: the watchdog's poll interval where pidfds are unavailable (> 0 seconds).

    Returns:
        the mechanisms installed: ``"pdeathsig"`` (when the launcher is the parent and prctl
        worked), ``"pidfd"`` or ``"poll"`` (the watchdog).

    Raises:
        ValueError: ``launcher_pid`` is this process, or ``poll_seconds`` is not positive.
    """
    if int(launcher_pid) == os.getpid():
        raise ValueError("die_with: launcher_pid is this process; pass the launcher's pid (os.getpid() there).")
    if not poll_seconds > 0:
        raise ValueError(f"die_with: poll_seconds must be > 0; got {poll_seconds}.")
    pid, parent = int(launcher_pid), os.getppid()
    how: list[str] = []
    # The kernel sends the parent-death signal when the parent *thread* that forked us ends: not
    # armed when torch starts workers from a thread pool (TORCH_MP_PARALLEL_START=1).
    pooled = os.environ.get("TORCH_MP_PARALLEL_START", "0") == "1"
    if parent == pid and not pooled and _set_pdeathsig(signal.SIGKILL):
        how.append("pdeathsig")
    if not is_running(pid) or (parent == pid and os.getppid() != parent):
        _kill_self()  # the launcher died before the signal was armed
    how.append("pidfd" if hasattr(os, "pidfd_open") else "poll")
    threading.Thread(target=_watch, args=(pid, float(poll_seconds), parent), name="robustagg-lifeline",
                     daemon=True).start()
    return how


# --- stop requests -------------------------------------------------------------------------------
_STOP = [0]


def request_stop(signum: int = int(signal.SIGTERM), frame: Any = None) -> None:
    """Record a stop request (usable directly as a signal handler); the first request wins.

    Args:
        signum: the signal number that asked for the stop (> 0).
        frame: ignored (the signal-handler signature).
    """
    if not _STOP[0]:
        _STOP[0] = int(signum)


def stop_requested() -> int:
    """The signal number of this process's pending stop request, 0 when there is none."""
    return _STOP[0]


def clear_stop() -> None:
    """Forget the pending stop request (a new run in the same process)."""
    _STOP[0] = 0


# --- heartbeats ----------------------------------------------------------------------------------
class Heartbeats:
    """A shared-memory table of ``(phase, completed steps, time.time())`` per worker.

    Created by the launcher before it starts the workers (it travels to them as an argument, for
    every start method); each worker writes its own row (:func:`attach`, then :func:`mark` and
    :func:`beat`), the launcher reads every row (:meth:`read`). Rows are three float64 each; a
    torn read shows a value from one of two consecutive writes, harmless for a report.

    Args:
        nprocs: number of workers (>= 1).
        ctx: the multiprocessing context of the start method (``multiprocessing.get_context``).

    Raises:
        ValueError: ``nprocs`` < 1.
    """

    def __init__(self, nprocs: int, ctx: Any) -> None:
        if int(nprocs) < 1:
            raise ValueError(f"Heartbeats: nprocs must be >= 1; got {nprocs}.")
        self.nprocs = int(nprocs)
        self.table = ctx.RawArray("d", 3 * self.nprocs)
        for i in range(self.nprocs):
            self.table[3 * i + 1] = -1.0
            self.table[3 * i + 2] = math.nan

    def write(self, index: int, *, phase: Optional[int] = None, step: Optional[int] = None) -> None:
        """Set row ``index``'s phase and/or step, and its time to now."""
        if phase is not None:
            self.table[3 * index] = float(phase)
        if step is not None:
            self.table[3 * index + 1] = float(step)
        self.table[3 * index + 2] = time.time()

    def read(self) -> list[dict[str, Any]]:
        """Every row: ``{"phase" (int), "phase_name", "step" (completed steps, -1 before the first
        heartbeat), "time" (``time.time()`` of the last write, NaN if never)}``."""
        out = []
        for i in range(self.nprocs):
            phase = int(self.table[3 * i])
            out.append({"phase": phase, "phase_name": PHASES.get(phase, str(phase)), "step": int(self.table[3 * i + 1]),
                        "time": float(self.table[3 * i + 2])})
        return out


_SLOT: list[Any] = [None, 0]


def attach(beats: Optional[Heartbeats], index: int) -> None:
    """Make :func:`mark` and :func:`beat` of this process write row ``index`` of ``beats``."""
    _SLOT[0], _SLOT[1] = beats, int(index)
    mark(STARTED)


def mark(phase: int) -> None:
    """Report this worker's phase (a no-op outside a spawned worker)."""
    if _SLOT[0] is not None:
        _SLOT[0].write(_SLOT[1], phase=phase)


def beat(step: int) -> None:
    """Report that this worker is training with ``step`` steps completed (a no-op outside a spawned worker)."""
    if _SLOT[0] is not None:
        _SLOT[0].write(_SLOT[1], phase=TRAINING, step=step)
