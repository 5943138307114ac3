"""The run lifecycle, owned by the library: launch, supervise, restore, shrink, lock, identity.

A researcher's own script gets what ``python -m experiments.train`` gets:

- :class:`Job` (what to run: ``build(ctx) -> WorkerParts`` plus :class:`RunSettings`) and
  :func:`launch` (run it: simulated, spawned processes with restarts and elastic shrink, or under
  torchrun), in :mod:`~robustagg.launch.job` and :mod:`~robustagg.launch.supervisor`;
- :mod:`~robustagg.launch.identity`: the experiment fingerprint and the check that a resume cannot
  mix two experiments;
- :mod:`~robustagg.launch.quorum`: the committed membership (epochs changed by a strict majority,
  fenced commits) and :mod:`~robustagg.launch.grow`: a replacement rejoining from a live peer;
- :mod:`~robustagg.launch.lock`: one launch per run directory;
- :mod:`~robustagg.launch.records`: failures, metrics settled on every start, the summary;
- :mod:`~robustagg.launch.worker`: the body every worker process runs;
- :mod:`~robustagg.launch.wandb_sink`: one W&B run per run directory, resumed across restarts.

See ``docs/howto/own-script.md`` for a complete script (own model and data, Adam, a stateful
attack, checkpoints, a SIGKILL and the restart, a shrink).
"""

from .identity import EXCLUDED, ResumeCheck, check_resume, code_revision, fingerprint, fingerprint_hash
from .job import Job, RunSettings, WorkerContext, WorkerParts, grow_job, shrink_job
from .lock import RunLock, RunLockedError
from .records import Attempt, last_step_reached, record_failure, settle_metrics, summary_from_records
from .supervisor import launch, prepare, read_summary, run_simulated, run_spawned, run_torchrun, spawned_entry
from .worker import run_joiner, run_worker

__all__ = ["EXCLUDED", "ResumeCheck", "check_resume", "code_revision", "fingerprint", "fingerprint_hash", "Job",
           "RunSettings", "WorkerContext", "WorkerParts", "shrink_job", "grow_job", "RunLock", "RunLockedError",
           "Attempt", "last_step_reached", "record_failure", "settle_metrics", "summary_from_records", "launch",
           "prepare", "read_summary", "run_simulated", "run_spawned", "run_torchrun", "spawned_entry", "run_worker",
           "run_joiner"]
