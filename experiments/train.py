"""Train a model with n workers, some Byzantine, aggregated by a robust rule: ``python -m experiments.train``.

The default (``conf/config.yaml``): scikit-learn digits, 10 worker processes over gloo, 2 of them
Byzantine running ALIE, coordinate-wise trimmed mean with f = 2. Common overrides::

    python -m experiments.train aggregator=krum attack=sign_flip threat.n=12 threat.f=3
    python -m experiments.train data.partition=dirichlet data.alpha=0.1 trainer.mode=simulated
    python -m experiments.train preaggregation=nnm logger=wandb seed=3
    python -m experiments.train run_name=alie-tm       # a stable folder outputs/alie-tm: kill, rerun = resume
    torchrun --standalone --nproc-per-node 10 -m experiments.train run_name=tr   # joins torchrun's group
    python -m experiments.train -m aggregator=krum,trimmed_mean seed=0,1        # a sweep

Under torchrun every rank composes the config; rank 0 decides the run directory and shares it with
every rank (``run_name=...`` makes it stable, so a re-run resumes). In a sweep, a configuration that breaks a requirement is skipped with the reason
in its run directory's ``skipped.json``.

Run files (in Hydra's run directory): ``metrics.jsonl`` (one record per step and per
evaluation), ``summary.json``, ``model.safetensors``, ``config_resolved.yaml``; with fault
tolerance on (``docs/howto/resume.md``) also ``checkpoints/`` (committed checkpoints,
``lineage.jsonl``, ``faults.jsonl``), ``evidence/rank-<r>.json`` after a failure and
``detections.jsonl``. Fault tolerance in one line::

    python -m experiments.train trainer.checkpoint.every=50 trainer.max_restarts=2 'faults=[crash]'
"""

from __future__ import annotations

import gc

#: True while the command line's start-up runs with the cyclic garbage collector paused. Start-up
#: builds millions of long-lived objects (torch and its compiler stack, which the first torch.optim
#: optimizer imports): each full collection while they are built walks all of them, and the final
#: collection at exit walks them once more, about 2 s of CPU in all on the development machine
#: (docs/performance.md, "Start-up"). Set here only when this file runs as ``__main__`` (never on
#: import), ended by :func:`_end_startup` once the run is built, before the first step.
_GC_PAUSED = False


def _end_startup() -> None:
    """End the command line's start-up pause of the garbage collector (a no-op unless it is paused).

    Also registered with :mod:`atexit` by the pause, so that an exit before that point (a
    rejected configuration, status 2) does not walk start-up's objects in its final collection.

    Moves every object alive now to the collector's permanent generation (:func:`gc.freeze`):
    torch's modules live as long as the process, so the collections during training and the one at
    exit no longer walk them; then collection resumes as usual, for the training loop's objects.
    Not collected first: one full collection of this heap costs about 0.5 s of CPU here, to free
    about 21,000 small objects (8 MB: tuples, dicts and functions that imports left in reference
    cycles), which stay. Tensors do not depend on the collector: the model and optimizer that
    ``validate`` builds to check them are freed by reference counting before this runs.
    """
    global _GC_PAUSED
    if _GC_PAUSED:
        _GC_PAUSED = False
        gc.freeze()
        gc.enable()


if __name__ == "__main__":
    import atexit

    _GC_PAUSED = gc.isenabled()
    gc.disable()
    atexit.register(_end_startup)

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from robustagg.errors import RobustAggError
from robustagg.training import atomic_write

from . import config as _config  # noqa: F401  (registers the structured-config schema and the run-dir resolver)
from .wiring import as_config, follows_steps, validate

__all__ = ["train", "main"]

log = logging.getLogger("experiments.train")


def _out_dir(cfg: DictConfig, out_dir: Optional[str | os.PathLike[str]]) -> Path:
    if out_dir is not None:
        return Path(out_dir)
    if cfg.get("out_dir"):
        return Path(str(cfg.out_dir))
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # pragma: no cover - Hydra internals
        pass
    from .config import run_dir_for

    return Path(run_dir_for(None, cfg.get("run_name")))


def train(cfg: Any, out_dir: Optional[str | os.PathLike[str]] = None, *, quiet: bool = False) -> dict[str, Any]:
    """Validate ``cfg`` and run it with the library's lifecycle (:func:`robustagg.launch.launch`).

    Args:
        cfg: the composed configuration (DictConfig or dict; merged into the schema).
        out_dir: the run directory (default: ``cfg.out_dir``, Hydra's run directory,
            ``outputs/<run_name>``, or ``outputs/<date>/<time>``).
        quiet: do not print the summary table.

    Returns:
        the summary (also written to ``summary.json``): final and best test accuracy, worst-class
        accuracy, mean kappa-hat, Byzantine-accepted rate, steps, wall seconds, seconds per step,
        where the run resumed from, its lineage, and the run's setting. Under torchrun, ranks other
        than 0 return ``{}``.

    Raises:
        ConfigError, AssumptionError: a bad configuration, before any process starts, and before
            anything is written (also: a resume that would mix two experiments, a run directory
            locked by another launch, a folder whose checkpoints all fail verification).
        WorkerFailedError: a worker process failed and no restart was left; the whole group was
            stopped (the survivors' evidence is in ``evidence/``).
        RobustAggError: in simulated mode, what the step raised (desync, integrity, ...).
    """
    from robustagg.launch import launch

    follows = follows_steps(cfg)  # before resolution: the keys configured as ${trainer.steps}
    typed = as_config(cfg)
    import torch

    torch.set_num_threads(int(typed.trainer.threads))  # the launcher does little; workers fork from it
    out = _out_dir(typed, out_dir)
    plan = validate(typed, out_dir=str(out), follows=follows)
    _end_startup()
    for v in plan.violations:
        log.warning("assumption: %s", v)
    for note in plan.notes:
        log.warning("%s", note)  # the derived requirement of the protocol (e.g. replica groups)
    if plan.batched_gradients:
        log.info("batched gradients: %s", plan.batched_gradients)  # trainer.batched_gradients, resolved
    t0 = time.perf_counter()
    text = OmegaConf.to_yaml(OmegaConf.create(plan.cfg))

    def write_config(job: Any) -> None:
        def write(tmp: str) -> None:
            Path(tmp).write_text(text)

        atomic_write(Path(job.run_dir) / "config_resolved.yaml", write)

    job = plan.job()
    summary = launch(job, on_ready=write_config, quiet=False)
    if not summary and Path(job.run_dir).resolve() != out.resolve():
        _discard_hydra_dir(out)  # a torchrun rank's own time-stamped folder: rank 0's is the run's
    if summary:
        summary["total_seconds"] = time.perf_counter() - t0
        if _multirun():  # one line per job, printed by experiments.sweep_progress: no table, no dict
            return summary
        if not quiet:
            from .sinks import print_summary

            print_summary(summary, title=f"{plan.rule_name} vs {plan.attack_name} "
                                         f"(n={plan.n}, f={plan.f}, {len(plan.byzantine_ranks)} Byzantine)")
        log.info("summary: %s", {k: summary[k] for k in ("final_test_acc", "worst_class_acc", "mean_kappa_hat",
                                                           "steps", "wall_seconds") if k in summary})
    return summary


def _multirun() -> bool:
    """This process runs a job of a Hydra ``-m`` sweep."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # pragma: no cover - Hydra internals
        return False


def _discard_rejected_run_dir() -> None:
    """Remove Hydra's run directory of a refused run if Hydra's own files are all it holds (a run that
    wrote anything of its own, metrics, checkpoints or evidence, keeps its folder)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # pragma: no cover - not under Hydra
        return
    _discard_hydra_dir(out)


#: Folders that existed before Hydra started (set by ``__main__``, :func:`experiments.config.folders_before_the_run`):
#: a refused run never removes one of them, nor the user's files in them.
_EXISTED: set[Path] = set()


def _discard_hydra_dir(out: Path) -> None:
    """Remove ``out`` if this command created it and it holds only Hydra's own files, then the
    folders above it that this left empty and this command created (``outputs/<date>/``,
    ``outputs/``), up to the working directory."""
    import shutil

    if out.resolve() in _EXISTED:
        return
    if not (out.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in out.iterdir())):
        return
    shutil.rmtree(out, ignore_errors=True)
    here = Path.cwd().resolve()
    up = out.resolve().parent
    while (up != here and here in up.parents and up not in _EXISTED and up.is_dir()
           and not any(up.iterdir())):
        up.rmdir()
        up = up.parent


def _exit_without_teardown() -> None:
    """End the command line after a run that returned normally, skipping the interpreter's teardown.

    Called only as the last statement of ``__main__``, after :func:`main` returned (an error or
    an interruption exits through :func:`sys.exit` before it, with its own status). By then every
    run file is written and fsynced (summary, metrics, checkpoints: :func:`robustagg.training.atomic_write`).
    What a normal exit would still do is done here, in its order: wait for the non-daemon
    threads (if one is alive, the normal exit is kept: nothing here must cut a thread short),
    run the ``atexit`` handlers (``logging.shutdown`` flushes and closes Hydra's ``train.log``;
    the W&B and multiprocessing handlers), flush stdout and stderr; then :func:`os._exit` with
    status 0 skips what is left: clearing every module and freeing torch's objects one by one
    (about 0.25 s of CPU on the development machine, docs/performance.md, "Start-up").
    """
    import atexit
    import threading

    main_thread = threading.main_thread()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main_thread):
        return
    atexit._run_exitfuncs()  # type: ignore[attr-defined]  # what Py_FinalizeEx runs first; stable since 3.0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(0)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra entry point: ``train(cfg)``; a bad configuration exits with status 2 and one message.

    In a multirun sweep, a configuration that breaks an assumption (a rule's requirement, more
    attackers than the declared f, an attack that cannot run at this n) is skipped, and a run whose
    training produced non-finite values is marked diverged: its run directory gets
    ``skipped.json`` with ``status`` (``"skipped"`` or ``"diverged"``), the reason and the error
    type, and the sweep goes on. Any other error (a misspelt key, an unknown name) fails the sweep.
    """
    from robustagg.errors import Interrupted

    try:
        summary = train(cfg)
    except Interrupted as exc:  # SIGTERM / SIGINT: a final checkpoint, every worker stopped
        print(str(exc), file=sys.stderr)
        sys.exit(exc.exit_code)
    except RobustAggError as exc:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from robustagg.errors import AssumptionError, NonFiniteInputError
        from robustagg.training import write_json

        status = ("skipped" if isinstance(exc, AssumptionError) else
                  "diverged" if isinstance(exc, NonFiniteInputError) else None)
        if status is not None and HydraConfig.get().mode == RunMode.MULTIRUN:
            out = Path(HydraConfig.get().runtime.output_dir)
            write_json(out / "skipped.json", {"status": status, "reason": str(exc), "type": type(exc).__name__})
            log.debug("%s: %s", status, exc)  # the sweep's progress line says it (experiments.sweep_progress)
            return math.nan
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            _discard_rejected_run_dir()  # a refused run (configuration, data file, ...) leaves no folder of Hydra's alone
        print(f"error: {exc}", file=sys.stderr)
        from .sweep_progress import record_current_job

        record_current_job("failed", exc)  # in a sweep: "[k of N done] ... failed" (Hydra never sees an exit)
        sys.exit(2)
    return float(summary.get("final_test_acc", math.nan))


if __name__ == "__main__":
    from .config import check_command_line, folders_before_the_run, run_dir_problem, run_name_problem

    _EXISTED = folders_before_the_run(sys.argv[1:])

    try:
        check_command_line(sys.argv[1:])  # faults=[crashh], trainer.stpes=5, threat.n=six: one line each
        for arg in sys.argv[1:]:  # Hydra resolves the run directory from run_name before any of our code
            value = arg.partition("=")[2]
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]  # run_name='' as Hydra reads it: the quoted string
            if arg.startswith("run_name=") and value not in ("null", "None") and run_name_problem(value):
                from robustagg.errors import ConfigError

                raise ConfigError(run_name_problem(value))
        if run_dir_problem(sys.argv[1:]):  # a read-only folder or a full disk: before Hydra writes there
            from robustagg.errors import StorageError

            raise StorageError(run_dir_problem(sys.argv[1:]))
    except RobustAggError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    main()
    _exit_without_teardown()
