"""Starting a worker group: a free port, process-group init with a timeout, spawn with failure reports.

Two ways in. By default the application spawns ``n`` worker processes itself (:func:`spawn`): a
free localhost port, gloo on CPU or NCCL with CUDA, one torch thread each. Started under
``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment, see :func:`from_environment`) it joins
that group instead. Either way a worker that raises ends the whole group: the collectives of the
others fail (connection closed) or time out (``timeout`` of :func:`init_group`), and :func:`spawn`
terminates the survivors and raises :class:`WorkerFailedError` naming the rank that failed first.

Which rank failed first is judged from what the workers left behind: a worker that raised writes a
failure record; a worker killed by a signal (or ``os._exit``) leaves none, and its peers then
report only a broken or timed-out collective. :class:`WorkerFailedError` therefore names as root
cause the first worker that raised something other than a collective error; failing that, a worker
that died without a record; failing that, a worker that had to be terminated (it stopped answering);
and lists every *lost* worker (died without a record, or terminated) for the supervisor, which may
continue without them (elastic shrink).

The launcher tells its own kills from external ones: a worker still running when the group failed
and then terminated (SIGTERM) or killed (SIGKILL, after it ignored SIGTERM for the grace period) by
:func:`spawn` is reported as stopped by the launcher, with the process state observed at the
failure (e.g. ``T``: stopped by SIGSTOP) and its last heartbeat (:mod:`.lifeline`); a worker gone
before the teardown died on its own. A rank that never joined the process group is named as such.

Stopping (:func:`spawn`, ``forward_signals=True``): SIGTERM or SIGINT to the launcher is forwarded
to every worker (as SIGUSR1; a worker also takes SIGTERM and SIGINT sent to it directly, e.g. by a
batch system or Ctrl-C, as a stop request). The workers agree in the next step header to stop
after that step, take a final committed checkpoint, and report
:class:`~robustagg.errors.Interrupted`; :func:`spawn` raises one :class:`~robustagg.errors.Interrupted`
("interrupted at step N; run the same command to resume"). A second signal stops the workers at
once (no final checkpoint). Every worker dies with the launcher (:func:`.lifeline.die_with`).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import Interrupted, RobustAggError
from . import lifeline
from .comm import CollectiveError

__all__ = ["free_port", "default_backend", "init_group", "destroy_group", "from_environment", "EnvRank",
           "spawn", "WorkerFailedError", "TerminatedError", "raise_on_sigterm", "Interrupted"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(*, backend: str, rank: int, world_size: int, timeout: timedelta,
               init_method: Optional[str] = None) -> None:
    """Initialise the default process group with a collective timeout.

    Under torchrun (its agent hosts the rendezvous store, ``TORCHELASTIC_USE_AGENT_STORE=True``)
    the group's keys are put under a prefix naming the restart (``TORCHELASTIC_RESTART_COUNT``):
    the agent's store outlives a failed attempt, and a restarted group must not read the
    addresses the previous attempt's processes published there.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        rank: this process's rank.
        world_size: the number of processes.
        timeout: how long any collective may wait for the others before it fails.
        init_method: ``"tcp://host:port"``; ``None`` reads ``MASTER_ADDR``/``MASTER_PORT`` (env://).

    Raises:
        CollectiveError: the group could not be formed within ``timeout`` (a peer never joined,
            or its address was unreachable); the backend's error is chained.
    """
    lifeline.mark(lifeline.JOINING)
    try:
        if init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                   is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"/robustagg/attempt_{attempt}", client)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                                    world_size=world_size, timeout=timeout)
    except RuntimeError as exc:  # DistStoreError, DistNetworkError: the rendezvous timed out, a peer is unreachable
        raise CollectiveError(f"rank {rank} could not join the group of {world_size} within "
                              f"{timeout.total_seconds():g} s ({type(exc).__name__}: {exc})") from exc
    lifeline.mark(lifeline.JOINED)


def destroy_group() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class EnvRank:
    """Rank, world size and local rank read from a launcher's environment (torchrun)."""

    rank: int
    world_size: int
    local_rank: int


def from_environment(environ: Optional[dict[str, str]] = None) -> Optional[EnvRank]:
    """The torchrun-style rank of this process, or ``None`` when ``RANK``/``WORLD_SIZE`` are unset.

    Example:
        >>> from_environment({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
        EnvRank(rank=1, world_size=4, local_rank=1)
        >>> from_environment({}) is None
        True
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return EnvRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


class WorkerFailedError(RobustAggError, RuntimeError):
    """A worker process of a spawned group failed; the group was stopped.

    Attributes:
        rank: the rank judged to have failed first (the root cause, not a peer that only saw the
            connection close), or ``-1`` when unknown.
        error_type: the exception's class name (``"signal SIGKILL"`` for a process killed by
            someone else than the launcher, ``"unresponsive"`` for a worker the launcher had to
            stop after its peers' collectives failed, ``"never_joined"`` for a rank that never
            joined the process group).
        failures: every failure record written by a worker that raised (rank, type, message, time,
            whether it was a collective error); terminated workers are in ``terminated``.
        lost: ranks whose process is gone without having observed a failure itself: killed by a
            signal, exited without a record, or terminated because it stopped answering.
        terminated: ranks the launcher sent SIGTERM after the first failure.
        killed: ranks the launcher sent SIGKILL (they ignored SIGTERM for the grace period).
        exitcodes: every process's exit code (negative: killed by that signal).
        states: ``{rank: process state}`` of the ranks still running when the failure was
            detected (the ``/proc/<pid>/stat`` letter: ``R`` running, ``S`` sleeping, ``D`` in I/O,
            ``T`` stopped by a signal, ``t`` stopped by a debugger).
        heartbeats: every rank's last heartbeat (phase, completed steps, time), see
            :class:`~robustagg.distributed.lifeline.Heartbeats`.
        stacks: ``{rank: where its main thread was}`` (:func:`where_it_was`) for the ranks still
            running at the teardown, from their ``faulthandler`` dumps.
    """

    def __init__(self, message: str, *, rank: int, error_type: str, failures: Sequence[dict[str, Any]],
                 lost: Sequence[int] = (), terminated: Sequence[int] = (),
                 exitcodes: Sequence[Optional[int]] = (), killed: Sequence[int] = (),
                 states: Optional[dict[int, str]] = None, heartbeats: Sequence[dict[str, Any]] = (),
                 stacks: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.failures = list(failures)
        self.lost = sorted(int(r) for r in lost)
        self.terminated = sorted(int(r) for r in terminated)
        self.killed = sorted(int(r) for r in killed)
        self.exitcodes = list(exitcodes)
        self.states = dict(states or {})
        self.heartbeats = list(heartbeats)
        self.stacks = dict(stacks or {})


class TerminatedError(RobustAggError, RuntimeError):
    """This worker received SIGTERM (its spawner or torchrun is stopping the group)."""


def raise_on_sigterm() -> None:
    """Turn SIGTERM into :class:`TerminatedError` in this process, so a stopped worker can still
    write its failure evidence before it exits (main thread only; a no-op elsewhere)."""

    def handler(signum: int, frame: Any) -> None:
        raise TerminatedError("received SIGTERM: the group is being stopped after a failure elsewhere")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


#: Created by the launcher in the failure folder before it terminates workers: from then on a
#: worker's SIGTERM means "the group is being torn down", not "stop at the next step boundary".
_TEARDOWN = "teardown"


def _worker_signals(failure_dir: str) -> None:
    """SIGUSR1 (the launcher's forwarded request), SIGINT and SIGTERM ask this worker to stop at the
    next agreed step boundary; once the launcher tears the group down, SIGTERM raises
    :class:`TerminatedError` (evidence is still written)."""
    marker = Path(failure_dir) / _TEARDOWN

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and marker.exists():
            raise TerminatedError("received SIGTERM: the group is being stopped by its launcher")
        lifeline.request_stop(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)


#: A worker's Python stacks, dumped by ``faulthandler`` on SIGUSR2 (the launcher asks for them
#: before it tears a failed group down, so that a hung rank's message says where it hung).
_STACK_SIGNAL = signal.SIGUSR2
_stack_file: Any = None


def _stack_path(failure_dir: str | Path, index: int) -> Path:
    return Path(failure_dir) / f"stacks-{index}.txt"


def _register_stack_dump(failure_dir: str, index: int) -> None:
    global _stack_file
    try:
        _stack_file = open(_stack_path(failure_dir, index), "w")  # kept open: faulthandler writes its fd
        faulthandler.register(_STACK_SIGNAL, file=_stack_file, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        _stack_file = None  # no dump: the messages just lack the frame


def where_it_was(text: str) -> str:
    r"""The innermost frames of the main thread in a ``faulthandler`` dump: ``"func (file:line)"``
    of the innermost frame, then of the innermost robustagg frame when that is another; ``""``
    when the dump is empty or unreadable.

    Example:
        >>> dump = ('Thread 0x1 (most recent call first):\n  File "/x/threading.py", line 3 in wait\n\n'
        ...         'Current thread 0x2 (most recent call first):\n'
        ...         '  File "/t/torch/distributed/c10d.py", line 9 in broadcast\n'
        ...         '  File "/r/robustagg/launch/grow.py", line 304 in send_state\n'
        ...         '  File "/r/robustagg/distributed/launch.py", line 240 in _entry\n')
        >>> where_it_was(dump)
        'broadcast (torch/distributed/c10d.py:9), called from send_state (robustagg/launch/grow.py:304)'
    """
    import re

    blocks = [b for b in text.split("\n\n") if "File " in b]
    main = next((b for b in blocks if " in _entry" in b), blocks[-1] if blocks else "")
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main)
    if not frames:
        return ""

    def short(path: str) -> str:
        parts = Path(path).parts
        for root in ("robustagg", "torch", "experiments"):
            if root in parts:
                return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
        return Path(path).name

    first = f"{frames[0][2]} ({short(frames[0][0])}:{frames[0][1]})"
    ours = next((f for f in frames if "robustagg" in Path(f[0]).parts), None)
    if ours is None or ours == frames[0]:
        return first
    return f"{first}, called from {ours[2]} ({short(ours[0])}:{ours[1]})"


def _stacks_of(procs: list[Any], running: Sequence[int], failure_dir: Path, wait_s: float = 0.5) -> dict[int, str]:
    """Ask every still-running worker for its Python stacks (SIGUSR2) and read where each main thread was."""
    asked = []
    for i in running:
        try:
            os.kill(procs[i].pid, _STACK_SIGNAL)
            asked.append(i)
        except OSError:
            continue
    if not asked:
        return {}
    time.sleep(wait_s)
    out = {}
    for i in asked:
        try:
            where = where_it_was(_stack_path(failure_dir, i).read_text())
        except OSError:
            continue
        if where:
            out[i] = where
    return out


def _write_record(failure_dir: str, index: int, record: dict[str, Any]) -> None:
    tmp = Path(failure_dir) / f".rank-{index}.json.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, Path(failure_dir) / f"rank-{index}.json")
    except OSError:
        pass


def _entry(index: int, fn: Callable[..., Any], failure_dir: str, args: tuple[Any, ...], launcher_pid: int,
           beats: Optional[lifeline.Heartbeats]) -> None:
    _worker_signals(failure_dir)
    _register_stack_dump(failure_dir, index)
    lifeline.die_with(launcher_pid)
    lifeline.attach(beats, index)
    try:
        fn(index, *args)
    except Interrupted as exc:  # an agreed stop: report it, exit 0 (the peers stop at the same step)
        _write_record(failure_dir, index, {"rank": index, "type": "Interrupted", "message": str(exc),
                                           "time": time.time(), "interrupted": True, "step": exc.step,
                                           "signum": exc.signum, "checkpointed": exc.checkpointed})
    except BaseException as exc:
        _write_record(failure_dir, index, {
            "rank": index, "type": type(exc).__name__, "message": str(exc), "time": time.time(),
            "collective": isinstance(exc, CollectiveError), "terminated": isinstance(exc, TerminatedError),
            "traceback": traceback.format_exc()})
        raise


def _root_cause(records: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The earliest record of a worker that raised something other than a collective error."""
    primary = [r for r in records if not r.get("collective") and not r.get("terminated")]
    return min(primary, key=lambda r: r["time"]) if primary else None


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped by a signal (SIGSTOP/SIGTSTP)",
           "t": "stopped by a debugger", "Z": "exited"}


def _proc_state(pid: Optional[int]) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``"?"`` where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, ValueError):
        return "?"


class _Signals:
    """SIGTERM/SIGINT handlers of the launcher while it supervises (main thread only): they count
    the signals and wake the supervision loop through a pipe."""

    def __init__(self, enabled: bool) -> None:
        self.signum = 0
        self.count = 0
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous: dict[int, Any] = {}
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        try:
            os.write(self.write_fd, b"!")
        except OSError:  # pragma: no cover - pipe full: the loop wakes anyway
            pass

    def __enter__(self) -> "_Signals":
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        os.close(self.read_fd)
        os.close(self.write_fd)

    def drain(self) -> None:
        os.set_blocking(self.read_fd, False)
        try:
            while os.read(self.read_fd, 64):
                pass
        except BlockingIOError:
            pass


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, start_method: str = "spawn",
          grace_seconds: float = 2.0, preload: Sequence[str] = (), forward_signals: bool = True,
          stop_timeout: Optional[float] = None, members: Optional[int] = None,
          on_failure: Optional[Callable[[], None]] = None) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and wait for all of them.

    Call-order contract: ``fn`` must be importable by name (a module-level function) and must set
    up (and tear down) its own process group, e.g. with :func:`init_group`.

    Every worker dies with the launcher, whatever the start method (:func:`.lifeline.die_with`),
    and reports its phase and steps in a shared heartbeat table (:func:`.lifeline.beat`, called
    by :func:`~robustagg.training.fit`).

    Stopping: with ``forward_signals`` (and when called from the main thread), SIGTERM or SIGINT
    to this process is forwarded to every worker; the workers stop after the step whose header
    carried the request (see :func:`~robustagg.training.fit`), take a final committed checkpoint
    and this function raises :class:`~robustagg.errors.Interrupted`. A second signal, or
    ``stop_timeout`` seconds without the workers stopping, terminates them at once (then
    :class:`~robustagg.errors.Interrupted` has ``step=None``: no final checkpoint). A caller's
    command-line entry point should print the exception and exit with its ``exit_code``
    (``128 + signal``: 143 for SIGTERM, 130 for SIGINT).

    Args:
        fn: the worker entry point.
        nprocs: number of processes (one per worker, >= 1).
        args: extra arguments (picklable).
        start_method: ``"spawn"`` (default, safest), ``"forkserver"`` or ``"fork"`` (fastest:
            nothing is imported again; safe when the parent runs no threaded or CUDA work before).
        grace_seconds: after the first failure, how long survivors get to exit before SIGTERM, and
            then how long before SIGKILL.
        preload: modules the forkserver imports once for all children (``"forkserver"`` only).
        forward_signals: handle SIGTERM/SIGINT in this process as a request to stop the workers
            (keyword-only; ``False`` leaves this process's handlers alone).
        stop_timeout: seconds the workers get to stop after a forwarded request before they are
            terminated (``None``: no limit; the collective timeout still ends a hung group).
        members: the first ``members`` processes form the group whose stop must agree (``None``:
            all of them). The others are replacements waiting to join it: one that was admitted
            stops with the group (same step); one that was not returns without a stop and takes
            no part in the agreement.
        on_failure: called once when the first failure is seen, before the survivors' grace
            period (the sharded-state rescue request, :mod:`~robustagg.training.shard_recovery`).

    Raises:
        WorkerFailedError: a worker raised or died; the message names the rank that failed first,
            its exception and message (or who stopped the process and the state it was in), and
            how many peers stopped because of it.
        Interrupted: the run was stopped by a signal (the message names the step and whether a
            final checkpoint was committed).
        ValueError: ``nprocs`` < 1.
    """
    if int(nprocs) < 1:
        raise ValueError(f"spawn: nprocs must be >= 1; got {nprocs}.")
    if start_method == "forkserver" and preload:
        multiprocessing.set_forkserver_preload(list(preload))
    beats = lifeline.Heartbeats(nprocs, multiprocessing.get_context(start_method))
    with tempfile.TemporaryDirectory(prefix="robustagg-failures-") as failure_dir, _Signals(forward_signals) as sig:
        ctx = mp.start_processes(_entry, args=(fn, failure_dir, tuple(args), os.getpid(), beats), nprocs=nprocs,
                                 join=False, start_method=start_method)
        procs = list(ctx.processes)
        try:
            _supervise(procs, Path(failure_dir), beats, sig, float(grace_seconds), stop_timeout,
                       len(procs) if members is None else int(members), on_failure)
        finally:  # whatever ends the supervision (also an exception in this process), no worker outlives it
            if any(p.is_alive() and _exists(p.pid) for p in procs):
                _stop_now(procs, Path(failure_dir), float(grace_seconds))


def _supervise(procs: list[Any], failure_dir: Path, beats: lifeline.Heartbeats, sig: _Signals, grace: float,
               stop_timeout: Optional[float], members: int, on_failure: Optional[Callable[[], None]] = None) -> None:
    """Wait for the workers; on a failure or a stop request, stop them and raise (the stop must be
    agreed by the first ``members`` processes and by every other one that reports a stop)."""
    forwarded: Optional[float] = None
    while True:
        codes = _exit_codes(procs)
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            if on_failure is not None:
                on_failure()
            err = _teardown(procs, failure_dir, beats, grace, first=failed[0])
            if sig.signum:
                raise Interrupted(None, signum=sig.signum,
                                  detail=f"The group failed while stopping: {str(err).splitlines()[0]}") from err
            raise err
        if all(c == 0 for c in codes):
            break
        if sig.signum and forwarded is None:
            forwarded = time.monotonic()
            for p in procs:
                if p.exitcode is None:
                    try:
                        os.kill(p.pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
        late = stop_timeout is not None and forwarded is not None and time.monotonic() - forwarded > stop_timeout
        if sig.count >= 2 or late:
            _stop_now(procs, failure_dir, grace)
            why = "a second signal" if sig.count >= 2 else f"the workers did not stop within {stop_timeout:g} s"
            raise Interrupted(None, signum=sig.signum, detail=f"The workers were terminated after {why}.")
        alive = [p.sentinel for p, c in zip(procs, codes) if c is None]
        # A sentinel stays unreadable while any process that inherited it lives, and a worker reaped
        # elsewhere never gets an exit code: wake up every second and look at the pids themselves.
        multiprocessing.connection.wait([*alive, sig.read_fd], timeout=1.0)
        sig.drain()
    records = _records(failure_dir)
    stopped = [r for r in records if r.get("interrupted")]
    if not stopped:
        return
    steps = sorted({r.get("step") for r in stopped}, key=str)
    signum = sig.signum or int(stopped[0].get("signum") or signal.SIGTERM)
    group = {int(r["rank"]) for r in stopped if int(r["rank"]) < members}
    if len(group) != members or len(steps) != 1 or steps[0] is None:  # a replacement never admitted: no vote
        raise Interrupted(None, signum=signum, detail=f"The ranks reported different stop steps: "
                          f"{ {int(r['rank']): r.get('step') for r in stopped} } of the {members} members.")
    raise Interrupted(int(steps[0]), signum=signum, checkpointed=all(bool(r.get("checkpointed")) for r in stopped))


def _exit_codes(procs: list[Any]) -> list[Optional[int]]:
    """Every worker's exit code; ``0`` for a worker whose process is gone but was reaped elsewhere
    (its exit status is lost; a failure it saw is still in its failure record), ``None`` while it runs."""
    codes: list[Optional[int]] = []
    for p in procs:
        code = p.exitcode
        if code is None and not _exists(p.pid):
            code = p.exitcode  # it exited and was reaped here just now, or was reaped elsewhere: None
            code = 0 if code is None else code
        codes.append(code)
    return codes


def _exists(pid: int) -> bool:
    """Whether pid ``pid`` exists (a child that exited but was not reaped yet still does: while its
    other threads finish, its main thread already reads as a zombie, and it cannot be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - the pid was reused by another user's process
        return True
    return True


def _stop_now(procs: list[Any], failure_dir: Path, grace: float) -> tuple[list[int], list[int]]:
    """SIGTERM (as a teardown) every live worker, SIGKILL those still alive after ``grace``."""
    (failure_dir / _TEARDOWN).touch()
    termed = [i for i, p in enumerate(procs) if p.is_alive() and _exists(p.pid)]
    for i in termed:
        procs[i].terminate()
    _join_all(procs, grace)
    killed = [i for i, p in enumerate(procs) if p.is_alive() and _exists(p.pid)]
    for i in killed:
        procs[i].kill()
    for p in procs:
        p.join()
    return termed, killed


def _join_all(procs: list[Any], seconds: float) -> None:
    end = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))


def _teardown(procs: list[Any], failure_dir: Path, beats: lifeline.Heartbeats, grace: float,
              first: int) -> WorkerFailedError:
    """Stop the group after worker ``first`` failed, observing who was still running and in which state."""
    detected = time.time()
    running = [i for i, c in enumerate(_exit_codes(procs)) if c is None]
    states = {i: _proc_state(procs[i].pid) for i in running}
    hb = beats.read()
    _join_all(procs, grace)  # survivors usually fail their own collective and exit
    stacks = _stacks_of(procs, [i for i in running if procs[i].is_alive()], failure_dir)
    termed, killed = _stop_now(procs, failure_dir, grace)
    return _failure(first, _exit_codes(procs), _records(failure_dir), detected=detected, states=states,
                    heartbeats=hb, terminated=termed, killed=killed, grace=grace, stacks=stacks)


def _records(failure_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in sorted(failure_dir.glob("rank-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _last_seen(hb: Sequence[dict[str, Any]], rank: int, detected: float) -> str:
    if rank >= len(hb) or hb[rank]["phase"] == 0:
        return "it never reached its entry point"
    b = hb[rank]
    where = f"{b['step']} steps completed" if b["phase"] == lifeline.TRAINING else b["phase_name"]
    return f"its last heartbeat: {where}, {max(0.0, detected - b['time']):.1f} s before the failure was detected"


def _stopped_by_launcher(rank: int, states: dict[int, str], killed: Sequence[int], grace: float,
                         stacks: Optional[dict[int, str]] = None) -> str:
    state = states.get(rank, "?")
    seen = f"its process was {_STATES[state]} when the group failed" if state in _STATES else ""
    if stacks and rank in stacks:
        seen = f"{seen}, in {stacks[rank]}" if seen else f"it was in {stacks[rank]}"
    how = (f"the launcher killed it with SIGKILL after it ignored SIGTERM for {grace:g} s" if rank in killed
           else "the launcher terminated it with SIGTERM")
    return "; ".join(x for x in (seen, how) if x) + " (the launcher's own kill, not an external one)"


def _failure(first: int, codes: list[Optional[int]], all_records: list[dict[str, Any]], *, detected: float,
             states: dict[int, str], heartbeats: Sequence[dict[str, Any]], terminated: Sequence[int],
             killed: Sequence[int], grace: float, stacks: Optional[dict[int, str]] = None) -> WorkerFailedError:
    """Build the :class:`WorkerFailedError` of a failed group from its records, exit codes, the
    ranks the launcher itself stopped, their observed states and their heartbeats."""
    by_rank = {int(r["rank"]): r for r in all_records}
    records = [r for r in all_records if not r.get("terminated") and not r.get("interrupted")]
    by_launcher = sorted(set(terminated) | {int(r["rank"]) for r in all_records if r.get("terminated")})
    silent = [i for i, c in enumerate(codes) if c not in (0, None) and i not in by_rank and i not in by_launcher]
    # a rank that recorded the failure it observed answered: stopped by the launcher afterwards (slow
    # to exit under load, past the grace period) it is not lost, its state is the committed one
    observed = {int(r["rank"]) for r in records}
    lost = sorted(set(silent) | (set(by_launcher) - observed))
    kw: dict[str, Any] = {"failures": records, "lost": lost, "terminated": by_launcher, "exitcodes": codes,
                          "killed": killed, "states": states, "heartbeats": list(heartbeats),
                          "stacks": dict(stacks or {})}
    root = _root_cause(records)
    if root is not None:
        others = sorted(r["rank"] for r in records if r is not root)
        tail = f" Ranks {others} stopped after it." if others else ""
        return WorkerFailedError(f"worker rank {root['rank']} failed: {root['type']}: {root['message']}.{tail}\n"
                                 f"--- traceback of rank {root['rank']} ---\n{root['traceback']}",
                                 rank=int(root["rank"]), error_type=str(root["type"]), **kw)
    peers = f" Ranks {sorted(r['rank'] for r in records)} then failed in a collective." if records else ""
    first_msg = f" First collective error: {records[0]['type']}: {records[0]['message']}" if records else ""
    if silent:
        rank = first if first in silent else silent[0]
        what = _exit_text(codes[rank])
        more = f" Also gone without a record: ranks {[r for r in silent if r != rank]}." if len(silent) > 1 else ""
        return WorkerFailedError(f"worker rank {rank} died ({what}) without raising a Python exception, before the "
                                 f"launcher stopped the group ({_last_seen(heartbeats, rank, detected)}).{peers}{more}",
                                 rank=rank, error_type=what, **kw)
    phase = {r: (heartbeats[r]["phase"] if r < len(heartbeats) else 0) for r in range(len(codes))}
    waiting = [r for r in range(len(codes)) if phase[r] >= lifeline.JOINING]
    absent = [r for r in by_launcher if phase[r] < lifeline.JOINING]
    if absent and waiting:
        rank = absent[0]
        where = "never reached its entry point" if phase[rank] == 0 else "had not called init_group"
        also = f" Ranks {absent[1:]} never joined either." if len(absent) > 1 else ""
        return WorkerFailedError(f"worker rank {rank} never joined the group: it {where} when ranks "
                                 f"{[r for r in waiting if r not in absent]} gave up waiting for it; "
                                 f"{_stopped_by_launcher(rank, states, killed, grace, stacks)}.{also}{first_msg}",
                                 rank=rank, error_type="never_joined", **kw)
    if by_launcher:
        def rank_key(r: int) -> tuple[int, int, float, int]:
            b = heartbeats[r] if r < len(heartbeats) else {"step": -1, "time": 0.0}
            return (0 if states.get(r) in ("T", "t") else 1, int(b["step"]), float(b["time"] or 0.0), r)

        rank = min(by_launcher, key=rank_key)
        elsewhere = [f"rank {r}: {w}" for r, w in sorted((stacks or {}).items()) if r != rank]
        seen = f" Where the other running ranks were: {'; '.join(elsewhere)}." if elsewhere else ""
        return WorkerFailedError(f"worker rank {rank} stopped answering and was terminated after its peers' "
                                 f"collectives failed: {_stopped_by_launcher(rank, states, killed, grace, stacks)}; "
                                 f"{_last_seen(heartbeats, rank, detected)}.{peers}{seen}{first_msg}",
                                 rank=rank, error_type="unresponsive", **kw)
    if records:
        root = min(records, key=lambda r: r["time"])
        return WorkerFailedError(f"worker rank {root['rank']} failed: {root['type']}: {root['message']}.\n"
                                 f"--- traceback of rank {root['rank']} ---\n{root['traceback']}",
                                 rank=int(root["rank"]), error_type=str(root["type"]), **kw)
    what = _exit_text(codes[first]) if 0 <= first < len(codes) else "unknown"
    return WorkerFailedError(f"worker rank {first} died ({what}); the group was stopped.", rank=first,
                             error_type=what, **kw)
