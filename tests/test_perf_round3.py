"""docs/performance.md's "Round 3" quotes only committed files (issue 25): every table and measured line of the
section is what ``scripts/perf_round3.py`` renders from ``docs/results/performance/``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("perf_round3", ROOT / "scripts" / "perf_round3.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _section() -> str:
    text = (ROOT / "docs" / "performance.md").read_text()
    start = text.index("### Round 3:")
    return text[start:text.index("\n### ", start + 1)]


@pytest.mark.parametrize("part", ["step_table", "startup_table", "byzfl_table", "small_d_table", "sweep_line",
                                  "grid_line", "linesearch_line", "projection_line"])
def test_the_round_3_section_quotes_the_committed_files(part):
    rendered = getattr(_renderer(), part)()
    assert rendered in _section(), f"docs/performance.md's Round 3 differs from {part}(): run scripts/perf_round3.py"


def test_the_verdicts_follow_the_targets():
    """A verdict is 'met' exactly when the ratio is at most the target (the rows as bench_train judged them)."""
    import csv

    with (ROOT / "docs" / "results" / "performance" / "bench_train.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["target"]]
    assert len(rows) == 12
    for r in rows:
        ratio, target = float(r["ratio_to_floor"]), float(r["target"])
        assert (r["verdict"] == "met") == (ratio <= target), r
        if r["verdict"] != "met":
            assert r["verdict"] == f"missed by {ratio - target:.2f}"
