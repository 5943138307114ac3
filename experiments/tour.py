"""The main job (``make run``): the contrast the toolkit exists for, in one small table.

``python -m experiments.tour [overrides...]`` trains the plain mean and a robust rule, each with no
attack, with an attack that breaks the mean (Gaussian noise, sigma = 200) and with one built to slip past
coordinate-wise rules (ALIE, Baruch et al., NeurIPS 2019), on the bundled digits data with
n = 10 workers of which 3 are Byzantine (f = 3, where ALIE's z is 0.52 and it bites), all from the
same seed, in the simulated mode (bit-identical to processes on CPU). The table shows final and
worst-class test accuracy and mean κ̂ = ‖F − x̄_H‖² / V(H): with no attack κ̂ measures
*suppression* (honest signal the rule throws away), under attack *integrity* (how far the attack
pushes the aggregate). Every override applies to every cell (``seed=1``, ``data=synthetic``,
``aggregator=krum``, ``trainer.steps=200`` ...); the robust rule of the table is ``aggregator``
(default ``trimmed_mean``). Run folders go to ``outputs/tour-<time>/<rule>-<attack>/`` (or
``out_dir=DIR``), with ``tour.json`` and ``tour.md`` beside them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["CELLS", "BASE", "tour", "markdown", "main"]

#: The table's attacks, in column order.
CELLS = ("none", "gaussian", "alie")
#: Settings of every cell (before the user's overrides).
BASE = ("trainer.mode=simulated", "logger=none", "trainer.progress=false", "threat.n=10", "threat.f=3",
        "trainer.eval_every=0")


def _split(overrides: Sequence[str]) -> tuple[str, str | None, list[str]]:
    rule, out, rest = "trimmed_mean", None, []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "aggregator":
            rule = value
        elif key == "out_dir":
            out = value
        else:
            rest.append(o)
    return rule, out, rest


def tour(overrides: Sequence[str] = (), *, quiet: bool = False) -> list[dict[str, Any]]:
    """Train every cell (rule in {mean, robust} x attack in :data:`CELLS`) and return one row per cell.

    Args:
        overrides: Hydra overrides applied to every cell (``aggregator=`` picks the robust rule,
            ``out_dir=`` the folder).
        quiet: do not print the table.

    Returns:
        rows ``{"rule", "attack", "final_test_acc", "worst_class_acc", "mean_kappa_hat", "byz_accepted_rate",
        "run_dir"}``.

    Raises:
        ConfigError, AssumptionError: a bad override (before the first cell trains).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from robustagg.errors import ConfigError

    from .train import train
    from .wiring import validate

    from .config import check_command_line

    check_command_line(list(overrides))  # make run ARGS='threat.n=six': the app's one line, before Hydra
    rule, out, rest = _split(overrides)
    root = Path(out) if out else Path("outputs") / time.strftime("tour-%Y%m%d-%H%M%S")
    conf = Path(__file__).resolve().parents[1] / "conf"
    cells = [(r, a) for r in ("mean", rule) for a in CELLS]
    cfgs = []
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for r, a in cells:  # compose and validate every cell before the first one trains
            strict = ["strict=false"] if r == "mean" else []  # the mean runs as the baseline at f = 3
            try:
                cfg = compose("config", overrides=[*BASE, f"aggregator={r}", f"attack={a}", *strict, *rest])
            except (HydraException, OmegaConfBaseException) as exc:
                raise ConfigError(f"{exc}".strip().replace("\n", " ")) from None
            validate(cfg)
            cfgs.append(cfg)
    rows = []
    for (r, a), cfg in zip(cells, cfgs):
        s = train(cfg, out_dir=root / f"{r}-{a}", quiet=True)
        rows.append({"rule": r, "attack": a, **{k: _finite(s.get(k)) for k in ("final_test_acc", "worst_class_acc",
                                                                               "mean_kappa_hat", "byz_accepted_rate")},
                     "run_dir": s["run_dir"]})
    root.mkdir(parents=True, exist_ok=True)
    (root / "tour.json").write_text(json.dumps(rows, indent=1) + "\n")
    (root / "tour.md").write_text(markdown(rows))
    if not quiet:
        name = cfgs[0].data.name
        _print(rows, root, str(getattr(name, "value", name)))  # DataName.digits -> digits
    return rows


def _finite(v: Any) -> Any:
    """``None`` for a missing or non-finite number (strict JSON), the value otherwise."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _num(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of :func:`tour`'s rows (the README's tables are this, from a committed ``tour.json``)."""
    lines = ["| rule | attack | final acc | worst-class acc | mean κ̂ |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['attack']} | {_num(r['final_test_acc'], '.3f')} | "
                     f"{_num(r['worst_class_acc'], '.3f')} | {_num(r['mean_kappa_hat'], '.3g')} |")
    return "\n".join(lines) + "\n"


def _print(rows: list[dict[str, Any]], root: Path, data: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{data}, n = 10, 3 Byzantine (f = 3), same seed: suppression (no attack) vs integrity",
                  header_style="bold")
    for col in ("rule", "attack", "final acc", "worst-class acc", "mean κ̂"):
        table.add_column(col, justify="left" if col in ("rule", "attack") else "right")
    for r in rows:
        table.add_row(r["rule"], r["attack"], _num(r["final_test_acc"], ".3f"), _num(r["worst_class_acc"], ".3f"),
                      _num(r["mean_kappa_hat"], ".3g"))
    console = Console(soft_wrap=True)
    console.print(table)
    console.print(f"run folders and tour.md: {root}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.tour [overrides...]``; a bad override exits with status 2 and one message."""
    from robustagg.errors import RobustAggError

    try:
        tour(list(sys.argv[1:] if argv is None else argv))
    except RobustAggError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
