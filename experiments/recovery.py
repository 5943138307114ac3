"""Fault-tolerance settings of a Hydra config, checked before launch (wiring only).

:func:`check_faults` and :func:`checkpoint_dir` are what :func:`experiments.wiring.validate` adds to
a :class:`~experiments.wiring.Plan`. The lifecycle itself (restore, restarts, shrink, evidence, the
run lock, resume checks) is the library's: :mod:`robustagg.launch`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from robustagg.errors import ConfigError
from robustagg.training import Fault

from .config import Mode

__all__ = ["check_faults", "checkpoint_dir"]


def check_faults(cfg: DictConfig, n: int, *, under_torchrun: bool = False) -> list[Fault]:
    """The configured faults, checked against this run (workers, steps, checkpoints, mode).

    Raises:
        ConfigError: a bad kind or option, a worker or step that does not exist, a checkpoint
            fault at a step without a checkpoint, ``corrupt`` without the gather reduction, faults
            in the simulated mode, or ``on_failure=shrink`` where the app does not launch workers.
    """
    tr = cfg.trainer
    steps, every = int(tr.steps), int(tr.checkpoint.every)
    faults = []
    for name, node in cfg.faults.items():
        d = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()}  # type: ignore[union-attr]
        fault = Fault(name=str(name), **d)  # raises ConfigError for bad kinds and options
        if not 0 <= fault.rank < n:
            raise ConfigError(f"faults.{name}: rank {fault.rank} does not exist among n={n} workers.")
        if fault.step > steps:
            raise ConfigError(f"faults.{name}: step {fault.step} is after the last step (trainer.steps={steps}).")
        at_checkpoint = fault.kind.startswith("checkpoint") or (fault.kind == "crash" and fault.where == "after_commit")
        if at_checkpoint and (every == 0 or (fault.step % every and fault.step != steps)):
            raise ConfigError(f"faults.{name}: no checkpoint is written at step {fault.step} (trainer.checkpoint.every="
                              f"{every}, trainer.steps={steps}); use a multiple of every, or the last step.")
        if fault.kind == "partition":
            _check_partition(name, fault, n, str(tr.on_failure))
        if fault.kind == "rejoin" and not (str(tr.on_failure) == "shrink" and bool(tr.rejoin)):
            raise ConfigError(f"faults.{name}: a rejoin needs trainer.on_failure=shrink and trainer.rejoin=true (the "
                              "survivors continue without the worker, then its replacement joins them).")
        faults.append(fault)
    in_process = [f for f in faults if f.kind not in SIMULATED_KINDS]
    if in_process and Mode(tr.mode) is not Mode.processes:
        raise ConfigError("fault injection needs trainer.mode=processes for "
                          f"{', '.join(sorted({f.kind for f in in_process}))}: faults kill, stall or desynchronise real worker processes (the "
                          f"simulated mode hosts every worker in one process; it replays {', '.join(SIMULATED_KINDS)}).")
    if under_torchrun and bool(tr.rejoin):
        raise ConfigError("trainer.rejoin=true is not available under torchrun: torchrun's elastic agent restarts the "
                          "whole worker group on a membership change (abort and restore) and cannot add a process to "
                          "a running group. Run without torchrun (python -m experiments.train trainer.mode=processes "
                          "...), or set trainer.rejoin=false and let torchrun restart the group (--max-restarts).")
    if str(tr.on_failure) == "shrink" and (Mode(tr.mode) is not Mode.processes or under_torchrun):
        raise ConfigError("trainer.on_failure=shrink needs the app's own launcher (trainer.mode=processes, not under "
                          "torchrun): it restarts the surviving workers as a smaller group.")
    return faults


#: Fault kinds the simulated mode replays too (they change a value, not a process).
SIMULATED_KINDS = ("aggregator_lie",)


def _check_partition(name: str, fault: Fault, n: int, on_failure: str) -> None:
    """A partition cuts off some, not all, existing workers, and needs a membership quorum (shrink)."""
    outside = [w for w in fault.workers if not 0 <= w < n]
    if outside:
        raise ConfigError(f"faults.{name}: workers {outside} do not exist among n={n} workers.")
    if len(fault.workers) >= n:
        raise ConfigError(f"faults.{name}: a partition must leave someone on the other side; workers="
                          f"{list(fault.workers)} names all n={n} workers.")
    if on_failure != "shrink":
        raise ConfigError(f"faults.{name}: a partition needs trainer.on_failure=shrink (the side that holds a strict "
                          f"majority of the membership continues without the other); got {on_failure}.")


def checkpoint_dir(cfg: DictConfig, out_dir: str) -> str:
    """The checkpoint folder (``trainer.checkpoint.dir`` or ``<out_dir>/checkpoints``), absolute.

    The folder is not created here. When it will be written (an explicit ``trainer.checkpoint.dir``,
    checkpoints, faults or restarts) a write test creates and removes a temporary folder in it, or
    in its nearest existing parent, so nothing is left behind. ``resume=never`` on a folder that
    holds checkpoints is settled by :func:`robustagg.launch.prepare` (a run folder starts over in a
    new one; an explicit ``trainer.checkpoint.dir`` outside it is refused).

    Raises:
        ConfigError: the folder or one of its parents is a file, it cannot be created or written
            (``/proc``, a read-only mount, no permission), or ``resume`` names a folder that is not
            a committed checkpoint.
    """
    d = cfg.trainer.checkpoint.dir
    path = Path(str(d)) if d else Path(out_dir) / "checkpoints"
    tr = cfg.trainer
    writes = bool(d) or int(tr.checkpoint.every) > 0 or bool(cfg.faults) or int(tr.max_restarts) > 0
    _check_folder(path, "trainer.checkpoint.dir" if d else "the checkpoint folder <run dir>/checkpoints",
                  write_test=writes)
    resume = str(cfg.trainer.resume)
    if resume not in ("auto", "never") and not (Path(resume) / "manifest.json").is_file():
        raise ConfigError(f"trainer.resume={resume!r} is not a committed checkpoint folder (no manifest.json); "
                          "use auto, never, or a folder such as <dir>/step-00000040.")
    return str(path.resolve())


def _check_folder(path: Path, key: str, *, write_test: bool) -> None:
    """Refuse a folder that is a file, sits under a file, or cannot be created or written (see checkpoint_dir)."""
    shown = f"{key}={path}" if key.startswith("trainer.") else f"{key} ({path})"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{shown} cannot be a folder: {probe} is a file; choose another folder (it is created "
                          "if missing), or leave trainer.checkpoint.dir null for <run dir>/checkpoints.")
    if not write_test:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe))
    except OSError as exc:
        raise ConfigError(f"{shown} cannot be created or written ({probe}: {exc.strerror or exc}); choose a "
                          "writable folder, or leave trainer.checkpoint.dir null for <run dir>/checkpoints.") from None
