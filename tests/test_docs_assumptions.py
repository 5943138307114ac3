"""The assumptions page (docs/assumptions.md) is generated from the code and must agree with it.

If a test here fails after you changed a rule: run ``python scripts/gen_assumptions.py`` and commit
the updated page (add the rule's cost to ``COST`` in that script if it is new).
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

import robustagg as ra
from robustagg import registry
from robustagg.aggregators.base import Aggregator
from robustagg.requirements import Requirement, linear

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "assumptions.md"


def _load_script():
    spec = importlib.util.spec_from_file_location("gen_assumptions", ROOT / "scripts" / "gen_assumptions.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_assumptions", mod)
    spec.loader.exec_module(mod)
    return mod


gen = _load_script()


def _table_lines(text: str) -> list[str]:
    block = text[text.index(gen.BEGIN) + len(gen.BEGIN):text.index(gen.END)]
    table = [ln for ln in block.splitlines() if ln.startswith("|")]
    return table[2:]  # below the header and the |---| separator


def test_committed_page_matches_the_code():
    text = PAGE.read_text(encoding="utf-8")
    assert gen.splice(text, gen.render()) == text, (
        "docs/assumptions.md is out of date: run python scripts/gen_assumptions.py")
    assert gen.main(["--check"]) == 0


def test_every_builtin_rule_and_map_has_exactly_one_row_with_its_requirement():
    lines = _table_lines(PAGE.read_text(encoding="utf-8"))
    names = [re.match(r"\| `([^`]+)`", ln).group(1) for ln in lines]
    builtin = [n for n in ra.available() if registry.lookup(n).__module__.startswith("robustagg.")]
    assert sorted(names) == sorted(builtin) and len(names) == len(set(names))
    # Spot-check the cells against the Requirement objects themselves (not against the generator).
    row = dict(zip(names, lines))
    assert "`n >= 2f + 3`" in row["krum"] and "`6(1 + f/(n-2f))`" in row["krum"]
    assert "`n >= 4f + 3`" in row["bulyan"] and "El Mhamdi" in row["bulyan"]
    assert "`f = 0`" in row["mean"]
    assert "pre-aggregation" in row["nnm"] and "`(8f/(n-f))(kappa_F + 1)`" in row["nnm"]
    for name in builtin:
        req = registry.lookup(name)().requirement
        if req is not None:
            assert f"`{req.inequality}`" in row[name], name


def test_kappa_values_are_the_requirement_bounds_at_the_reference_point():
    n, f = gen.REFERENCE_N, gen.REFERENCE_F
    # Krum: 6 (1 + f/(n-2f)) = 6 (1 + 2/7) = 54/7 = 7.714...; CWTM: (12/7)(9/7) = 108/49 = 2.204...
    assert ra.Krum(f=f).requirement.kappa_bound(n, f) == pytest.approx(54 / 7)
    rows = {r.name: r for r in gen.rows()}
    assert rows["krum"].kappa_value == "7.71"
    assert rows["trimmed_mean"].kappa_value == "2.2"
    assert rows["coordinate_median"].kappa_value == "6.61"  # 4 (9/7)^2 = 324/49 = 6.612...
    assert rows["mda"].kappa_value == gen.DASH  # no bound in the literature: a dash, never a made-up number
    # Every rule's requirement holds at the reference point, so every stated bound gets a number.
    for r in gen.rows():
        req = registry.lookup(r.name)().requirement
        if req is not None and req.kappa is not None:
            assert not math.isnan(req.kappa_bound(n, f)), r.name


def test_a_changed_requirement_makes_the_check_fail(monkeypatch):
    from robustagg.aggregators.krum import Krum

    text = PAGE.read_text(encoding="utf-8")
    changed = property(lambda self: linear("Krum", 2, 4, self.paper))
    monkeypatch.setattr(Krum, "requirement", changed)
    new = gen.splice(text, gen.render())
    assert new != text and "`n >= 2f + 4`" in new


def test_a_rule_without_a_cost_is_refused(monkeypatch):
    monkeypatch.delitem(gen.COST, "krum")
    with pytest.raises(KeyError, match=r"no cost for 'krum'; add it to COST"):
        gen.render()


def test_rules_registered_outside_the_library_are_not_listed(monkeypatch):
    class Outside(Aggregator):  # defined in this test module, not in robustagg
        display_name = "Outside"

        @property
        def requirement(self) -> Requirement:
            return linear("Outside", 2, 1, "nowhere")

        def _aggregate(self, x):
            return x.mean(dim=0)

        def _weights(self, x):
            return x.new_full((x.shape[0],), 1.0 / x.shape[0])

    monkeypatch.setitem(registry._REGISTRY, "docs_test_outside", Outside)
    assert "docs_test_outside" in ra.available()
    assert "docs_test_outside" not in gen.render()


def test_check_mode_and_atomic_rewrite_on_a_copy(tmp_path):
    page = tmp_path / "assumptions.md"
    page.write_text(f"# t\n\n{gen.BEGIN}\nstale\n{gen.END}\n\ntail\n", encoding="utf-8")
    assert gen.main(["--check", "--page", str(page)]) == 1
    assert gen.main(["--page", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "stale" not in text and text.endswith(f"{gen.END}\n\ntail\n") and "| `krum` |" in text
    assert gen.main(["--check", "--page", str(page)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["assumptions.md"]  # no temp file left behind


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="markers"):
        gen.splice("no markers here", "table")
