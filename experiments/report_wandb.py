"""Log a sweep report to Weights & Biases: tables as ``wandb.Table``, figures as ``wandb.Image``.

The report goes to one run (``job_type="report"``) in the sweep's group, so a W&B report can put
the sweep's runs and its tables side by side. Offline by default (no network; ``wandb sync``
later); ``$WANDB_MODE`` wins over the ``mode`` argument, so tests set ``WANDB_MODE=disabled``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from .report_tables import Report, pivot, slug

__all__ = ["log_report", "sweep_group"]


def sweep_group(report: Report) -> str:
    """The W&B group of the sweep: the runs' ``logger.group`` when they agree on one, else the
    sweep folder's name (``<experiment>/<date_time>`` for the experiments of this repository)."""
    groups = [g for g in report.results.get("group", pd.Series(dtype=object)).dropna().unique() if str(g)]
    if len(groups) == 1:
        return str(groups[0])
    root = Path(str(report.results["run_dir"].iloc[0])).parent if len(report.results) else report.out_dir.parent
    return "/".join(root.parts[-2:])


def _table(df: pd.DataFrame) -> Any:
    import wandb

    clean = df.copy()
    for col in clean.columns:
        if clean[col].dtype == object:
            clean[col] = clean[col].map(lambda v: "" if v is None else str(v))
    return wandb.Table(dataframe=clean.reset_index(drop=True))


def log_report(report: Report, *, mode: Optional[str] = None, project: Optional[str] = None) -> Optional[str]:
    """Log ``report``'s tables and PNG figures to a W&B run named ``report``; returns the run's
    folder (``None`` when W&B is disabled). The run is finished even when logging fails."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or mode or "offline"
    projects = [p for p in report.results.get("project", pd.Series(dtype=object)).dropna().unique() if str(p)]
    project = project or (str(projects[0]) if projects else "robustagg")
    group = sweep_group(report)
    run = wandb.init(project=project, group=group, job_type="report", name=f"report-{Path(group).name}",
                     mode=mode,  # type: ignore[arg-type]
                     dir=str(report.out_dir), config={"sweep_dir": str(report.out_dir.parent)}, reinit="finish_previous")
    failed = True
    try:
        payload: dict[str, Any] = {"results": _table(report.results.drop(columns=["setting_json"], errors="ignore")),
                                   "tradeoff": _table(report.tradeoff)}
        for setting in report.settings:
            key = slug(setting)
            payload[f"accuracy/{key}"] = _table(pivot(report.results, "final_acc", setting).reset_index())
            payload[f"worst_class_accuracy/{key}"] = _table(pivot(report.results, "worst_class_acc", setting).reset_index())
        for path in report.files:
            if path.suffix == ".png":
                payload[f"figures/{path.stem}"] = wandb.Image(str(path), caption=path.stem)
        run.log(payload)
        counts = report.results["status"].value_counts()
        for status in ("ok", "skipped", "diverged", "invalid", "failed", "missing"):
            run.summary[f"runs/{status}"] = int(counts.get(status, 0))
        run.summary["settings"] = " | ".join(report.settings)
        failed = False
        return str(getattr(run, "dir", "")) or None
    finally:
        run.finish(exit_code=1 if failed else 0)
