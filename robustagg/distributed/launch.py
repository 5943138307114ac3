"""Starting a worker group: a free port, process-group init with a timeout, spawn with failure reports.

Two ways in. By default the application spawns ``n`` worker processes itself (:func:`spawn`): a
free localhost port, gloo on CPU or NCCL with CUDA, one torch thread each. Started under
``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment, see :func:`from_environment`) it joins
that group instead. Either way a worker that raises ends the whole group: the collectives of the
others fail (connection closed) or time out (``timeout`` of :func:`init_group`), and :func:`spawn`
terminates the survivors and raises :class:`WorkerFailedError` naming the rank that failed first.
"""

from __future__ import annotations

import json
import os
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
           "spawn", "WorkerFailedError"]


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

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        rank, world_size: this process's rank and the number of processes.
        timeout: how long any collective may wait for the others before it fails.
        init_method: ``"tcp://host:port"``; ``None`` reads ``MASTER_ADDR``/``MASTER_PORT`` (env://).
    """
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
        error_type: the exception's class name (``"signal SIGKILL"`` for a killed process).
        failures: every failure record written by the workers (rank, type, message, time).
    """

    def __init__(self, message: str, *, rank: int, error_type: str, failures: Sequence[dict[str, Any]]) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.failures = list(failures)


def _entry(index: int, fn: Callable[..., Any], failure_dir: str, args: tuple[Any, ...]) -> None:
    try:
        fn(index, *args)
    except BaseException as exc:
        record = {"rank": index, "type": type(exc).__name__, "message": str(exc), "time": time.time(),
                  "collective": isinstance(exc, CollectiveError), "traceback": traceback.format_exc()}
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
    if not records:
        return None
    primary = [r for r in records if not r.get("collective")] or records
    return min(primary, key=lambda r: r["time"])


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
            records = []
            for p in sorted(Path(failure_dir).glob("rank-*.json")):
                try:
                    records.append(json.loads(p.read_text()))
                except (OSError, ValueError):
                    continue
            root = _root_cause(records)
            if root is None:
                code = getattr(exc, "exit_code", None)
                sig = getattr(exc, "signal_name", None)
                rank = int(getattr(exc, "error_index", -1))
                what = f"signal {sig}" if sig else f"exit code {code}"
                raise WorkerFailedError(f"worker rank {rank} died ({what}) without raising a Python exception; "
                                        "the group was stopped.", rank=rank, error_type=what,
                                        failures=records) from None
            others = sorted(r["rank"] for r in records if r is not root)
            tail = f" Ranks {others} stopped after it." if others else ""
            raise WorkerFailedError(f"worker rank {root['rank']} failed: {root['type']}: {root['message']}.{tail}\n"
                                    f"--- traceback of rank {root['rank']} ---\n{root['traceback']}",
                                    rank=int(root["rank"]), error_type=str(root["type"]),
                                    failures=records) from None
