"""The console summary of a run (the W&B sink is the library's: :mod:`robustagg.launch.wandb_sink`)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

__all__ = ["print_summary"]


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4g}"
    return str(v)


def _lineage_line(r: Mapping[str, Any]) -> str:
    if r.get("event") == "shrink":
        return f"shrink {r.get('old_n')}->{r.get('new_n')} at step {r.get('step')}"
    if r.get("event") == "experiment_changed":
        return f"experiment changed at step {r.get('step')}: {', '.join(r.get('changes') or {})}"
    frm = r.get("restored_from")
    replay = r.get("steps_replayed") or []
    text = f"restart {r.get('restart')}: from step {frm}" if frm is not None else f"restart {r.get('restart')}: from 0"
    return text + (f", replayed {replay[0]}-{replay[1]}" if replay else "")


def print_summary(summary: Mapping[str, Any], *, title: Optional[str] = None) -> None:
    """Print the run summary as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or "run summary", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ["rule", "attack", "n", "f", "byzantine", "mode", "data", "partition", "final_test_acc", "best_test_acc",
            "worst_class_acc", "final_test_loss", "mean_kappa_hat", "byz_accepted_rate", "dropped_rows",
            "assumption_violated", "steps", "steps_this_run", "wall_seconds", "seconds_per_step", "run_dir"]
    for k in keys:
        if k in summary:
            table.add_row(k, _fmt(summary[k]))
    if summary.get("resumed_from") is not None:
        table.add_row("resumed from", f"step {summary['resumed_from']} ({summary.get('resumed_checkpoint')}, verified)")
    lineage = [r for r in summary.get("lineage") or [] if r.get("event") in ("restore", "shrink", "experiment_changed")]
    if lineage:
        table.add_row("lineage", "; ".join(_lineage_line(r) for r in lineage))
    Console(soft_wrap=True).print(table)
