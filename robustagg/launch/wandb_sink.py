"""Weights & Biases as a record sink of a run that may restart: one W&B run per run directory.

The W&B run id is persisted in ``<run dir>/wandb_run.json`` at the first start; every later start
(a restart after a failure, or the same command run again after a kill) resumes that run with
``resume="allow"`` instead of creating a second run of the same name. W&B's step counter only moves
forward, so a restored run does not rewind it: records of steps W&B already holds (the steps a
restart replays) are **skipped**, and the last logged step is persisted beside the id. W&B offline
mode is the default (no network needed); ``$WANDB_MODE`` overrides.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping

__all__ = ["WandbSink", "WANDB_STATE"]

#: File in the run directory that holds the W&B run id and the last logged step.
WANDB_STATE = "wandb_run.json"


class WandbSink:
    """Logs every record to the run directory's one W&B run (see the module docstring).

    Args:
        logger: ``{"project", "entity", "mode", "group", "tags"}`` (missing keys: defaults).
        config: the resolved run configuration (stored with the run).
        out_dir: the run directory (W&B writes its ``wandb/`` folder there; the id file lives there).
        name: the run's display name.

    Attributes:
        run_id: the W&B run id (the same across restarts of one run directory).
        last_step: the highest step logged so far (records at or below it are skipped).
        resumed: this start continued an existing W&B run.
    """

    def __init__(self, logger: Mapping[str, Any], config: Mapping[str, Any], out_dir: str, name: str) -> None:
        import wandb

        self._wandb = wandb
        self._state = Path(out_dir) / WANDB_STATE
        saved = self._read()
        self.resumed = bool(saved.get("id"))
        self.run_id = str(saved.get("id") or uuid.uuid4().hex[:16])
        self.last_step = int(saved.get("last_step", -1))
        mode: Any = os.environ.get("WANDB_MODE") or str(logger.get("mode", "offline"))
        self.run = wandb.init(project=str(logger.get("project", "robustagg")), entity=logger.get("entity"),
                              mode=mode, dir=out_dir, config=dict(config), group=logger.get("group"),
                              tags=list(logger.get("tags") or []), name=name, id=self.run_id, resume="allow",
                              reinit="finish_previous", settings=wandb.Settings(quiet=True, console="off"))
        self._write(sync=True)
        self.failed = False

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self, *, sync: bool = False) -> None:
        from ..checkpoint import open_for_writing

        tmp = self._state.with_name(f".{self._state.name}.{os.getpid()}.tmp")
        with os.fdopen(open_for_writing(tmp), "w") as fh:  # never through a link planted at the temp name
            json.dump({"id": self.run_id, "last_step": self.last_step}, fh)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, self._state)

    def log(self, record: dict[str, Any], step: int) -> None:
        """Log the numeric fields of ``record`` at ``step`` unless W&B already holds that step."""
        if step < self.last_step or (step == self.last_step and record.get("kind") == "train"):
            return  # replayed after a restore: W&B keeps the first account of the step
        data = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step",)}
        self.run.log(data, step=step)
        if step > self.last_step:
            self.last_step = step
            self._write()

    def sync(self) -> None:
        """Persist the last logged step durably (called before a checkpoint commits)."""
        self._write(sync=True)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Store the run summary (final numbers) in the W&B run."""
        for k, v in values.items():
            if isinstance(v, (int, float, str, bool)):
                self.run.summary[k] = v

    def close(self) -> None:
        """Finish the W&B run (exit code 1 after a failure) and persist the last step."""
        self._write(sync=True)
        self.run.finish(exit_code=1 if self.failed else 0)
