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
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RobustAggError
from .comm import CollectiveError

__all__ = ["free_port", "default_backend", "init_group", "destroy_group", "from_environment", "EnvRank",
           "spawn", "WorkerFailedError", "TerminatedError", "raise_on_sigterm"]


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
    """
    if init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                               is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"/robustagg/attempt_{attempt}", client)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=timeout)


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
        error_type: the exception's class name (``"signal SIGKILL"`` for a killed process,
            ``"unresponsive"`` for a worker terminated after its peers' collectives failed).
        failures: every failure record written by a worker that raised (rank, type, message, time,
            whether it was a collective error); terminated workers are in ``terminated``.
        lost: ranks whose process is gone without having observed a failure itself: killed by a
            signal, exited without a record, or terminated because it stopped answering.
        terminated: ranks terminated by the spawner (SIGTERM) after the first failure.
        exitcodes: every process's exit code (negative: killed by that signal).
    """

    def __init__(self, message: str, *, rank: int, error_type: str, failures: Sequence[dict[str, Any]],
                 lost: Sequence[int] = (), terminated: Sequence[int] = (),
                 exitcodes: Sequence[Optional[int]] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.failures = list(failures)
        self.lost = sorted(int(r) for r in lost)
        self.terminated = sorted(int(r) for r in terminated)
        self.exitcodes = list(exitcodes)


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


def _entry(index: int, fn: Callable[..., Any], failure_dir: str, args: tuple[Any, ...]) -> None:
    raise_on_sigterm()
    try:
        fn(index, *args)
    except BaseException as exc:
        record = {"rank": index, "type": type(exc).__name__, "message": str(exc), "time": time.time(),
                  "collective": isinstance(exc, CollectiveError), "terminated": isinstance(exc, TerminatedError),
                  "traceback": traceback.format_exc()}
        tmp = Path(failure_dir) / f".rank-{index}.json.tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(record, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, Path(failure_dir) / f"rank-{index}.json")
        except OSError:
            pass
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


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, start_method: str = "spawn",
          grace_seconds: float = 2.0, preload: Sequence[str] = ()) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and wait for all of them.

    Call-order contract: ``fn`` must be importable by name (a module-level function) and must set
    up (and tear down) its own process group, e.g. with :func:`init_group`.

    Args:
        fn: the worker entry point.
        nprocs: number of processes (one per worker).
        args: extra arguments (picklable).
        start_method: ``"spawn"`` (default, safest), ``"forkserver"`` or ``"fork"`` (fastest:
            nothing is imported again; safe when the parent runs no threaded or CUDA work before).
        grace_seconds: after the first failure, how long survivors get to exit before SIGTERM.
        preload: modules the forkserver imports once for all children (``"forkserver"`` only).

    Raises:
        WorkerFailedError: a worker raised or died; the message names the rank that failed first,
            its exception and message, and how many peers stopped because of it.
    """
    if start_method == "forkserver" and preload:
        import multiprocessing

        multiprocessing.set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory(prefix="robustagg-failures-") as failure_dir:
        ctx = mp.start_processes(_entry, args=(fn, failure_dir, tuple(args)), nprocs=nprocs, join=False,
                                 start_method=start_method)
        try:
            while not ctx.join(grace_period=grace_seconds):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _failure(exc, ctx, Path(failure_dir)) from None


def _failure(exc: BaseException, ctx: Any, failure_dir: Path) -> WorkerFailedError:
    """Build the :class:`WorkerFailedError` of a failed group from its records and exit codes."""
    all_records: list[dict[str, Any]] = []
    for p in sorted(failure_dir.glob("rank-*.json")):
        try:
            all_records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    codes: list[Optional[int]] = [proc.exitcode for proc in ctx.processes]
    by_rank = {int(r["rank"]): r for r in all_records}
    records = [r for r in all_records if not r.get("terminated")]
    terminated = sorted(int(r["rank"]) for r in all_records if r.get("terminated"))
    silent = [i for i, c in enumerate(codes) if c not in (0, None) and i not in by_rank]
    lost = sorted(set(silent) | set(terminated))
    kw: dict[str, Any] = {"failures": records, "lost": lost, "terminated": terminated, "exitcodes": codes}
    root = _root_cause(records)
    if root is not None:
        others = sorted(r["rank"] for r in records if r is not root)
        tail = f" Ranks {others} stopped after it." if others else ""
        return WorkerFailedError(f"worker rank {root['rank']} failed: {root['type']}: {root['message']}.{tail}\n"
                                 f"--- traceback of rank {root['rank']} ---\n{root['traceback']}",
                                 rank=int(root["rank"]), error_type=str(root["type"]), **kw)
    peers = f" Ranks {sorted(r['rank'] for r in records)} then failed in a collective." if records else ""
    if silent:
        first = int(getattr(exc, "error_index", -1))
        rank = first if first in silent else silent[0]
        what = _exit_text(codes[rank])
        more = f" Also gone without a record: ranks {[r for r in silent if r != rank]}." if len(silent) > 1 else ""
        return WorkerFailedError(f"worker rank {rank} died ({what}) without raising a Python exception; the group "
                                 f"was stopped.{peers}{more}", rank=rank, error_type=what, **kw)
    if terminated:
        rank = terminated[0]
        first_msg = f" First collective error: {records[0]['type']}: {records[0]['message']}" if records else ""
        return WorkerFailedError(f"worker rank {rank} stopped answering and was terminated after its peers' "
                                 f"collectives failed.{peers}{first_msg}", rank=rank, error_type="unresponsive", **kw)
    if records:
        root = min(records, key=lambda r: r["time"])
        return WorkerFailedError(f"worker rank {root['rank']} failed: {root['type']}: {root['message']}.\n"
                                 f"--- traceback of rank {root['rank']} ---\n{root['traceback']}",
                                 rank=int(root["rank"]), error_type=str(root["type"]), **kw)
    rank = int(getattr(exc, "error_index", -1))
    what = _exit_text(codes[rank]) if 0 <= rank < len(codes) else "unknown"
    return WorkerFailedError(f"worker rank {rank} died ({what}); the group was stopped.", rank=rank,
                             error_type=what, **kw)
