"""Weights & Biases as a record sink of a run that may restart: one W&B run per run directory.

The W&B run id is persisted in ``<run dir>/wandb_run.json`` at the first start; every later start
(a restart after a failure, or the same command run again after a kill) resumes that run with
``resume="allow"`` instead of creating a second run of the same name. W&B's step counter only moves
forward, so a restored run does not rewind it: records of steps W&B already holds (the steps a
restart replays) are **skipped**, and the last logged step is persisted beside the id. W&B offline
mode is the default (no network needed); ``$WANDB_MODE`` overrides.

Start-up is off the training's critical path: importing ``wandb`` and ``wandb.init`` (about 10 s
on the development machine, most of it the W&B service process starting) run in a background
thread, which then sends the records to W&B in order. :meth:`WandbSink.log` only queues a record,
so the first step does not wait for W&B; :meth:`WandbSink.close` waits for the queue to drain.
A W&B that cannot start is a warning, not a failed run: ``metrics.jsonl`` holds every record.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["WandbSink", "WANDB_STATE"]

log = logging.getLogger("robustagg.launch")

#: Seconds :meth:`WandbSink.close` waits for W&B to start and take the queued records.
CLOSE_TIMEOUT_S = 600.0

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
        run: the ``wandb`` run (waits for the background start-up; ``None`` if W&B did not start).
    """

    def __init__(self, logger: Mapping[str, Any], config: Mapping[str, Any], out_dir: str, name: str) -> None:
        self._state = Path(out_dir) / WANDB_STATE
        saved = self._read()
        self.resumed = bool(saved.get("id"))
        self.run_id = str(saved.get("id") or uuid.uuid4().hex[:16])
        self.last_step = int(saved.get("last_step", -1))
        mode: Any = os.environ.get("WANDB_MODE") or str(logger.get("mode", "offline"))
        kwargs = dict(project=str(logger.get("project", "robustagg")), entity=logger.get("entity"), mode=mode,
                      dir=out_dir, config=dict(config), group=logger.get("group"), tags=list(logger.get("tags") or []),
                      name=name, id=self.run_id, resume="allow", reinit="finish_previous")
        self._write(sync=True)  # the id is known before W&B starts: a restart resumes the same run
        self.failed = False
        self._run: Any = None
        self._error: Optional[BaseException] = None
        self._ready = threading.Event()
        self._queue: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(kwargs,), name="wandb-sink", daemon=True)
        self._thread.start()

    def _serve(self, kwargs: dict[str, Any]) -> None:
        """The background thread: start W&B, then apply the queued operations in order."""
        try:
            import wandb

            self._run = wandb.init(**kwargs, settings=wandb.Settings(quiet=True, console="off"))
        except BaseException as exc:  # noqa: BLE001 - reported by close(); the run goes on without W&B
            self._error = exc
        finally:
            self._ready.set()
        while True:
            op, arg = self._queue.get()
            if op == "finish":
                if self._run is not None:
                    self._run.finish(exit_code=arg)
                return
            if self._run is None:
                continue
            try:
                if op == "log":
                    self._run.log(arg[0], step=arg[1])
                elif op == "summary":
                    for k, v in arg.items():
                        self._run.summary[k] = v
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the others
                self._error = self._error or exc

    @property
    def run(self) -> Any:
        """The ``wandb`` run, once started (blocks until the background start-up has finished)."""
        self._ready.wait()
        return self._run

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
        self._queue.put(("log", (data, step)))
        if step > self.last_step:
            self.last_step = step
            self._write()

    def sync(self) -> None:
        """Persist the last logged step durably (called before a checkpoint commits)."""
        self._write(sync=True)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Store the run summary (final numbers) in the W&B run."""
        self._queue.put(("summary", {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}))

    def close(self) -> None:
        """Finish the W&B run (exit code 1 after a failure), waiting up to :data:`CLOSE_TIMEOUT_S`
        for the queued records, and persist the last step. A W&B that did not start, or refused a
        record, is reported as a warning."""
        self._write(sync=True)
        self._queue.put(("finish", 1 if self.failed else 0))
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("W&B did not finish within %.0f s; metrics.jsonl holds every record", CLOSE_TIMEOUT_S)
        elif self._error is not None:
            what = "did not start" if self._run is None else "refused a record"
            log.warning("W&B %s (%s: %s); metrics.jsonl holds every record", what, type(self._error).__name__,
                        self._error)
