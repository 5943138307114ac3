"""How far a sweep is: one line per finished job, one summary at the end (a Hydra callback).

``conf/hydra/default.yaml`` registers :class:`SweepProgress` for every ``-m`` run of
``python -m experiments.train``. At the start of the sweep it counts the jobs the sweeper will
launch (:func:`count_jobs`, Hydra's own expansion of the sweep lists); every job, when it ends,
appends its status to ``<sweep dir>/sweep_progress.jsonl`` and prints::

    [3 of 30 done] #2 krum vs alie, iid, seed 0: final acc 0.912 (4.1 s)

and the last job to finish (or the end of the sweep, when a job never reported) prints::

    sweep finished: 27 done, 0 failed, 3 skipped (of 30 jobs), wall time 2 min 5 s
    report: python -m experiments.report multirun/integrity_vs_suppression_quick/2024-01-01_12-00-00

The count lives in files of the sweep folder (written under an exclusive ``flock``), not in the
launcher's process, so it is right for jobs run in parallel worker processes (the joblib launcher)
or on other machines that share the folder (SLURM). Statuses: ``ok`` (trained; also counted as
done), ``skipped`` and ``diverged`` (``skipped.json``: the sweep goes on; counted as skipped) and
``failed`` (any other error). A job that is recorded twice (a sweep folder run again) counts once,
with its last status.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hydra.experimental.callback import Callback

__all__ = ["SweepProgress", "count_jobs", "start", "finish_job", "complete", "summary", "record_current_job",
           "PROGRESS_FILE", "JOBS_FILE"]

#: One JSON line per finished job: ``{"job", "status", "line", "time"}``.
PROGRESS_FILE = "sweep_progress.jsonl"
#: ``{"jobs": N, "started": unix time}``, written when the sweep starts.
JOBS_FILE = "sweep_progress.json"


def count_jobs(params: Mapping[str, Any], overrides: Sequence[str]) -> int:
    """Number of jobs Hydra's basic sweeper launches for the sweeper's ``params`` (the experiment's
    ``hydra.sweeper.params``) and the command line's ``overrides`` (which replace a list of the
    same key), computed with the sweeper's own parser and expansion.

    Example:
        >>> count_jobs({"attack": "none,alie"}, ["seed=0,1,2", "trainer.steps=3"])
        6
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))


def start(sweep_dir: str | os.PathLike[str], *, jobs: int) -> None:
    """Record that a sweep of ``jobs`` jobs starts now in ``sweep_dir`` (creates the folder)."""
    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / JOBS_FILE).write_text(json.dumps({"jobs": int(jobs), "started": time.time()}) + "\n")


def _read(root: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    try:
        meta = json.loads((root / JOBS_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    last: dict[int, dict[str, Any]] = {}
    try:
        lines = (root / PROGRESS_FILE).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
            last[int(rec["job"])] = rec
        except (ValueError, KeyError, TypeError):
            continue  # a torn line of a killed job
    return meta, last


def finish_job(sweep_dir: str | os.PathLike[str], job: int, status: str, text: str) -> str:
    """Record that job number ``job`` ended with ``status`` and return its progress line,
    ``"[k of N done] #job text"`` (``"[k done]"`` when the sweep's size is unknown)."""
    return _finish(sweep_dir, job, status, text)[0]


def _finish(sweep_dir: str | os.PathLike[str], job: int, status: str, text: str) -> tuple[str, bool]:
    """:func:`finish_job`, and whether this record is the one that completed the sweep: decided under
    the same lock as the count, so of two jobs that end together exactly one prints the summary."""
    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    rec = {"job": int(job), "status": str(status), "line": str(text), "time": time.time()}
    with open(root / PROGRESS_FILE, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # count and append as one step: parallel jobs get distinct k
        try:
            was_complete = complete(root)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            meta, last = _read(root)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    k = len(last)
    of = f" of {meta['jobs']}" if meta.get("jobs") else ""
    completed = not was_complete and bool(meta.get("jobs")) and k >= int(meta["jobs"])
    return f"[{k}{of} done] #{job} {text}", completed


def complete(sweep_dir: str | os.PathLike[str]) -> bool:
    """Every job of the sweep (as counted by :func:`start`) has reported."""
    meta, last = _read(Path(sweep_dir))
    return bool(meta.get("jobs")) and len(last) >= int(meta["jobs"])


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m} min {s} s" if h else f"{m} min {s} s" if m else f"{s} s"


def summary(sweep_dir: str | os.PathLike[str]) -> str:
    """The end-of-sweep summary: jobs done, failed and skipped, the wall time since :func:`start`,
    and the report command for ``sweep_dir``."""
    root = Path(sweep_dir)
    meta, last = _read(root)
    statuses = [r["status"] for r in last.values()]
    done = statuses.count("ok")
    failed = statuses.count("failed")
    skipped = len(statuses) - done - failed
    total = int(meta.get("jobs") or len(statuses))
    missing = total - len(statuses)
    wall = time.time() - float(meta.get("started", math.nan))
    head = (f"sweep finished: {done} done, {failed} failed, {skipped} skipped (of {total} jobs"
            + (f"; {missing} did not report" if missing > 0 else "") + f"), wall time {_duration(wall)}")
    return f"{head}\nreport: python -m experiments.report {root}"


def _describe(config: Any) -> str:
    """``rule vs attack, partition, seed s`` of a job's composed config (best effort)."""
    try:
        from omegaconf import OmegaConf

        from .report_config import describe_run

        keys = [str(k) for k in config if k != "hydra"]
        try:
            plain = OmegaConf.to_container(OmegaConf.masked_copy(config, keys), resolve=True, enum_to_str=True)
        except Exception:  # noqa: BLE001 - an interpolation that needs the job's own context
            plain = OmegaConf.to_container(OmegaConf.masked_copy(config, keys), resolve=False, enum_to_str=True)
        assert isinstance(plain, dict)
        d = describe_run({str(k): v for k, v in plain.items()})
        return f"{d['rule']} vs {d['attack']}, {d['heterogeneity']}, seed {d['seed']}"
    except Exception:  # noqa: BLE001 - the line is a courtesy; never fail a job over it
        return "job"


def job_line(config: Any, status: str, run_dir: Path, error: Optional[BaseException]) -> str:
    """The text after ``[k of N done] #j`` for a job that ended with ``status``."""
    what = _describe(config)
    if status == "failed":
        return f"{what}: failed: {type(error).__name__}: {error}" if error is not None else f"{what}: failed"
    if status in ("skipped", "diverged"):
        try:
            reason = json.loads((run_dir / "skipped.json").read_text()).get("reason", "")
        except (OSError, ValueError):
            reason = ""
        return f"{what}: {status}: {reason}"
    try:
        s = json.loads((run_dir / "summary.json").read_text())
        acc, wall = float(s.get("final_test_acc", math.nan)), float(s.get("total_seconds", s.get("wall_seconds", math.nan)))
        return f"{what}: final acc {acc:.3f} ({wall:.1f} s)"
    except (OSError, ValueError, TypeError):
        return f"{what}: done"


def _status(run_dir: Path, failed: bool) -> str:
    if failed:
        return "failed"
    try:
        return str(json.loads((run_dir / "skipped.json").read_text()).get("status", "skipped"))
    except (OSError, ValueError):
        return "ok"


def _report(sweep_dir: str, job: int, status: str, text: str) -> None:
    """Record a job, print its line, and print the summary when it was the last job to report
    (so the summary also comes when a failed job ends the sweep before Hydra's own end)."""
    line, completed = _finish(sweep_dir, job, status, text)
    print(line, flush=True)
    if completed:
        print(summary(sweep_dir), flush=True)


def _multirun_hydra() -> Any:
    """Hydra's config of the running job when it is part of a ``-m`` sweep, else ``None``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return None
    return hc if hc.mode == RunMode.MULTIRUN else None


def record_current_job(status: str, error: BaseException) -> None:
    """From inside a ``-m`` job (Hydra's config set): record that this job ends with ``status``
    because of ``error`` and print its line; a no-op outside a multirun. For the jobs that leave
    by ``sys.exit`` (a bad value: exit status 2), which Hydra's ``on_job_end`` never sees."""
    hc = _multirun_hydra()
    if hc is None:
        return
    _report(str(hc.sweep.dir), int(hc.job.num), status, f"failed: {type(error).__name__}: {error}")


class SweepProgress(Callback):
    """Hydra callback: the sweep's size at the start, a line per finished job, a summary at the end
    (see the module docstring). Does nothing outside ``-m`` (multirun) mode."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Count the jobs and record the start in the sweep folder."""
        from omegaconf import OmegaConf

        params = OmegaConf.to_container(config.hydra.sweeper.get("params") or {}, resolve=False)
        task = list(config.hydra.overrides.task)
        try:
            jobs = count_jobs(params if isinstance(params, dict) else {}, task)
        except Exception:  # noqa: BLE001 - another sweeper's syntax: the lines say "[k done]"
            jobs = 0
        start(config.hydra.sweep.dir, jobs=jobs)
        if jobs:
            print(f"sweep: {jobs} jobs, folder {config.hydra.sweep.dir}", flush=True)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """Record this job's status and print its progress line (multirun only)."""
        from hydra.core.utils import JobStatus

        hc = _multirun_hydra()
        if hc is None:
            return
        failed = job_return.status == JobStatus.FAILED
        run_dir = Path(hc.runtime.output_dir)  # the job's folder (working_dir is the cwd: chdir=false)
        error = job_return._return_value if failed else None
        status = _status(run_dir, failed)
        _report(str(hc.sweep.dir), int(hc.job.num), status, job_line(config, status, run_dir, error))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Print the summary and the report command, unless the last job to report printed it."""
        if not complete(config.hydra.sweep.dir):
            print(summary(config.hydra.sweep.dir), flush=True)
