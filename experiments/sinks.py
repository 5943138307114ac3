"""Record sinks of the experiments layer: Weights & Biases (rank 0 only) and the console summary."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

__all__ = ["WandbSink", "print_summary"]


class WandbSink:
    """Logs every record to a W&B run (offline by default: no network needed).

    The run's mode is ``$WANDB_MODE`` when set, else ``logger.mode``. :meth:`close` calls
    ``wandb.finish()``; the caller calls it in a ``finally`` so the run is closed even after a
    crash (with exit code 1 then).

    Args:
        logger: the ``logger`` config node (project, entity, mode, group, tags).
        config: the resolved run configuration (stored with the run).
        out_dir: the run directory (W&B writes its ``wandb/`` folder there).
        name: the run's display name.
    """

    def __init__(self, logger: Mapping[str, Any], config: Mapping[str, Any], out_dir: str, name: str) -> None:
        import wandb

        self._wandb = wandb
        mode: Any = os.environ.get("WANDB_MODE") or str(logger.get("mode", "offline"))
        self.run = wandb.init(project=str(logger.get("project", "robustagg")), entity=logger.get("entity"),
                              mode=mode, dir=out_dir, config=dict(config), group=logger.get("group"),
                              tags=list(logger.get("tags") or []), name=name, reinit="finish_previous",
                              settings=wandb.Settings(quiet=True, console="off"))
        self.failed = False

    def log(self, record: dict[str, Any], step: int) -> None:
        data = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step",)}
        self.run.log(data, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Store the run summary (final numbers) in the W&B run."""
        for k, v in values.items():
            if isinstance(v, (int, float, str, bool)):
                self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish(exit_code=1 if self.failed else 0)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4g}"
    return str(v)


def print_summary(summary: Mapping[str, Any], *, title: Optional[str] = None) -> None:
    """Print the run summary as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or "run summary", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ["rule", "attack", "n", "f", "byzantine", "mode", "data", "partition", "final_test_acc", "best_test_acc",
            "worst_class_acc", "final_test_loss", "mean_kappa_hat", "byz_accepted_rate", "dropped_rows",
            "assumption_violated", "steps", "wall_seconds", "seconds_per_step", "run_dir"]
    for k in keys:
        if k in summary:
            table.add_row(k, _fmt(summary[k]))
    Console(soft_wrap=True).print(table)
