"""A Hydra callback that records, in every job's folder, which process ran it and for how long.

Added to a sweep with ``hydra.callbacks`` (the integrity-vs-suppression experiments do)::

    python -m experiments.train -m +experiment=integrity_vs_suppression \\
        +hydra.callbacks.job_timing._target_=experiments.jobtiming.JobTiming   # any other sweep

Hydra calls ``on_job_start`` and ``on_job_end`` inside the process that runs the job (with the
joblib launcher: the loky worker), so the record shows whether a worker was reused: ``pid`` and
``job_in_process`` (1 for the first job a process ran, 2 for its second, ...).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

__all__ = ["JobTiming", "FILE"]

#: The record's file name in the job's output folder.
FILE = "job_timing.json"

_jobs_in_process = 0


class JobTiming(Callback):
    """Write ``job_timing.json`` (wall and CPU seconds of the job, the process id) into each job's folder.

    The record: ``pid`` (int), ``job_num`` (Hydra's ``hydra.job.num``), ``job_in_process`` (int,
    1-based count of the jobs this process has started), ``wall_s`` (float seconds, ``perf_counter``
    from ``on_job_start`` to ``on_job_end``: the job's configuration, the run, its files), ``cpu_s``
    (float seconds of CPU time of the whole process over the same span, ``time.process_time``:
    every thread, user and system), ``status`` (Hydra's job status name). No (n, f) assumption:
    it times whatever job Hydra runs. Never raises into the sweep (an unwritable folder only loses
    the record).
    """

    def __init__(self, **_: Any) -> None:
        self._t0 = 0.0
        self._c0 = 0.0

    def on_job_start(self, config: Any, **_: Any) -> None:
        """Hydra hook: start the clocks and count the job."""
        global _jobs_in_process
        _jobs_in_process += 1
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_job_end(self, config: Any, job_return: Any, **_: Any) -> None:
        """Hydra hook: write the record into the job's output folder."""
        wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
        try:
            from hydra.core.hydra_config import HydraConfig

            hc = HydraConfig.get()
            out = Path(hc.runtime.output_dir)
            rec = {"pid": os.getpid(), "job_num": int(hc.job.num) if hc.job.num is not None else None,
                   "job_in_process": _jobs_in_process, "wall_s": wall, "cpu_s": cpu,
                   "status": getattr(getattr(job_return, "status", None), "name", None)}
            (out / FILE).write_text(json.dumps(rec) + "\n")
        except Exception:  # pragma: no cover - a lost record must not fail the sweep
            pass
