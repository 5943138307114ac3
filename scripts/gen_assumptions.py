"""Generate the assumptions table of ``docs/assumptions.md`` from the code's ``Requirement`` objects.

Usage::

    python scripts/gen_assumptions.py            # rewrite the table between the markers
    python scripts/gen_assumptions.py --check    # exit 1 if the committed page is out of date

Every rule and pre-aggregation map registered by the library itself (``robustagg.registry``) is
built with its default hyperparameters; its row shows the requirement's inequality, the κ bound
formula and its value at a reference ``(n, f)`` (from ``Requirement.kappa_bound``), the breakdown
point, the cost and the paper. Only the cost is kept here (``COST``, keyed by registry name):
a newly registered rule without a cost entry makes the script fail, which is the reminder to add one.

``tests/test_docs_assumptions.py`` fails when the committed page and the code disagree.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import robustagg
from robustagg.aggregators.base import Aggregator
from robustagg.preaggregation.base import PreAggregator
from robustagg.registry import available, lookup
from robustagg.requirements import lower_bound_kappa

PAGE = Path(__file__).resolve().parent.parent / "docs" / "assumptions.md"
BEGIN = "<!-- BEGIN GENERATED TABLE: scripts/gen_assumptions.py (do not edit by hand) -->"
END = "<!-- END GENERATED TABLE -->"

#: The (n, f) at which the κ bounds are evaluated in the table. Every rule's requirement holds
#: there (Bulyan's n >= 4f + 3 is the tightest: 11 >= 11).
REFERENCE_N, REFERENCE_F = 11, 2

#: Time per call of each registered name, as the library computes it today (n rows, d coordinates).
#: T = max_iter (geometric median), L = iterations (centered clipping); for DnC T = iterations and
#: b = sub_dim; CAF runs at most n filter steps, each an (n, n) eigendecomposition; k = norms seen so far
#: (ClippedClustering's history); MeanShift(n), HDBSCAN(n): scikit-learn on n points. Coordinate-wise order
#: statistics run a pruned sorting network (O(n log² n) comparators per column), not a sort.
COST: dict[str, str] = {
    "mean": "O(nd)",
    "coordinate_median": "O(nd log² n)",
    "trimmed_mean": "O(nd log² n)",
    "meamed": "O(nd log² n)",
    "krum": "O(n²d + n² log n)",
    "multi_krum": "O(n²d + n² log n)",
    "bulyan": "O(n²d + n³ log n)",
    "geometric_median": "O(n²d + T·n²)",
    "centered_clipping": "O(n²d + L·n²)",
    "mda": "O(n²d + C(n, f)·(n − f)²)",
    "caf": "O(n²d + n⁴)",
    "smea": "O(n²d + C(n, f)·(n − f)³)",
    "monna": "O(nd + n log n)",
    "cge": "O(nd + n log n)",
    "dnc": "O(nd + T·(n²b + n³))",
    "nnm": "O(n²d + n² log n)",
    "bucketing": "O(nd)",
    "clipping": "O(nd)",
    "arc": "O(nd + n log n)",
    # similarity-based rules (part 2): a Gram pass, then clustering of n points
    "signguard": "O(n²d + MeanShift(n))",
    "clipped_clustering": "O(n²d + n³ + k log k)",
    "flame": "O(n²d + HDBSCAN(n))",
    "fltrust": "O(n²d)",
    "foolsgold": "O(n²d)",
}

DASH = "—"


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    name: str
    display: str
    kind: str
    inequality: str
    kappa_formula: str
    kappa_value: str
    breakdown: str
    cost: str
    paper: str


def _builtin_names() -> list[str]:
    """Registered names whose class is one of the library's own rules or maps (not a test's or a user's)."""
    out = []
    for name in available():
        cls = lookup(name)
        if cls.__module__.startswith(robustagg.__name__ + ".") and issubclass(cls, (Aggregator, PreAggregator)):
            out.append(name)
    return out


def _fmt(x: float) -> str:
    return DASH if math.isnan(x) else f"{x:.3g}"


def _code(text: str) -> str:
    return f"`{text}`" if text else DASH


def rows() -> list[Row]:
    """The table rows: rules first, then pre-aggregation maps, each group sorted by registry name.

    Raises:
        KeyError: a registered name has no entry in :data:`COST`.
    """
    out = []
    for name in _builtin_names():
        cls = lookup(name)
        obj = cls()
        req = obj.requirement
        is_rule = isinstance(obj, Aggregator)
        if name not in COST:
            raise KeyError(f"scripts/gen_assumptions.py: no cost for {name!r}; add it to COST.")
        if req is None:
            m = obj.output_rows(REFERENCE_N)
            inequality = "none of its own" + (
                f"; the next rule is checked on the rows it outputs ({m} from n = {REFERENCE_N} with the "
                "defaults)" if m != REFERENCE_N else "")
            formula, value, paper = DASH, DASH, cls.paper
            breakdown = DASH
        else:
            inequality = _code(req.inequality)
            formula = _code(req.kappa_formula or "")
            value = _fmt(req.kappa_bound(REFERENCE_N, REFERENCE_F))
            paper = req.paper or cls.paper
            breakdown = getattr(cls, "breakdown_point", "") or req.breakdown
        out.append(Row(name, cls.display_name or cls.__name__, "rule" if is_rule else "pre-aggregation",
                       inequality, formula, value, _code(breakdown) if breakdown != DASH else DASH,
                       COST[name], paper or DASH))
    return sorted(out, key=lambda r: r.kind != "rule")


def render() -> str:
    """The Markdown block that goes between the markers (markers excluded)."""
    head = (f"| `get` name | rule | kind | requirement (n, f) | κ bound | κ at n={REFERENCE_N}, f={REFERENCE_F} "
            "| breakdown point | cost | paper |")
    lines = [head, "|" + "---|" * 9]
    for r in rows():
        lines.append(f"| `{r.name}` | {r.display} | {r.kind} | {r.inequality} | {r.kappa_formula} | "
                     f"{r.kappa_value} | {r.breakdown} | {r.cost} | {r.paper} |")
    lb = lower_bound_kappa(REFERENCE_N, REFERENCE_F)
    lines += ["", f"No rule can do better than κ ≥ f/(n − 2f) = {lb:.3g} at n = {REFERENCE_N}, f = {REFERENCE_F} "
              "(`robustagg.lower_bound_kappa`)."]
    return "\n".join(lines)


def splice(text: str, block: str) -> str:
    """Replace what lies between :data:`BEGIN` and :data:`END` in ``text`` by ``block``.

    Raises:
        ValueError: a marker is missing or they are out of order.
    """
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} must both be present, in that order.")
    return text[:i + len(BEGIN)] + "\n" + block + "\n" + text[j:]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the code")
    parser.add_argument("--page", type=Path, default=PAGE, help="the Markdown page holding the markers")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new = splice(text, render())
    if args.check:
        if new != text:
            print(f"{args.page} is out of date: run python scripts/gen_assumptions.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        _write_atomic(args.page, new)
        print(f"updated {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
