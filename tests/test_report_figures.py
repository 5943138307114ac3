"""The report's figures as a paper needs them: fixed colours, at most three panels a row, shared
axes where panels are compared, visible error bars, labels that do not overlap, an honest axis
range, a floor for kappa-hat, and PNG, PDF or SVG output (issue 28, "Figures a paper can use")."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import matplotlib
import matplotlib.text
import numpy as np
import pandas as pd
import pytest

os.environ.setdefault("WANDB_MODE", "disabled")

from experiments import report as rep  # noqa: E402
from experiments import report_figures as rf  # noqa: E402
from experiments.report_style import ATTACK_COLORS, KAPPA_FLOOR, RULE_COLORS, attack_color, rule_color  # noqa: E402

RULES = ["mean", "coordinate_median", "trimmed_mean", "krum", "geometric_median"]


def _runs(rules: list[str], attacks: list[str], setting: str = "iid", seeds: int = 2) -> pd.DataFrame:
    rows = []
    for r, a, s in itertools.product(rules, attacks, range(seeds)):
        rows.append({"run_id": f"{setting}/{r}/{a}/{s}", "rule": r, "attack": a, "setting": setting, "seed": s,
                     "status": "ok", "n": 10, "f": 2})
    return pd.DataFrame(rows)


def _kappa(runs: pd.DataFrame, value: float = 0.5) -> pd.DataFrame:
    return pd.DataFrame([{"run_id": rid, "step": st, "kappa_hat": value * (1 + i % 3)}
                         for i, rid in enumerate(runs["run_id"]) for st in range(1, 6)])


def _curves(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for i, rid in enumerate(runs["run_id"]):
        for st in (0, 5, 10):
            rows.append({"run_id": rid, "step": st, "acc": 0.1 + 0.08 * st * (1 + i % 4), "loss": 2.0 - 0.1 * st})
    return pd.DataFrame(rows)


def _visible(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def _line_colors(fig) -> dict[str, str]:
    """Legend label -> colour (hex) of the figure-level legend's lines."""
    (legend,) = fig.legends
    out = {}
    for text, handle in zip(legend.get_texts(), legend.legend_handles):
        color = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()[0]
        out[text.get_text()] = matplotlib.colors.to_hex(color)
    return out


def test_one_colour_per_attack_and_per_rule_in_every_figure() -> None:
    # the same attack gets the same colour whichever other attacks the sweep ran (it was positional)
    a = _runs(["krum"], ["alie"])
    b = _runs(["krum"], ["sign_flip", "ipm", "alie"])
    for fig_fn in (lambda r: rf.kappa_curves(r, _kappa(r), "iid"), lambda r: rf.learning_curves(r, _curves(r), "iid")):
        ca, cb = _line_colors(fig_fn(a)), _line_colors(fig_fn(b))
        assert ca["attack: alie"] == cb["attack: alie"] == attack_color("alie")
        assert cb["attack: sign_flip"] == attack_color("sign_flip")
    # rules: the trade-off scatter and the availability lines read the same mapping
    assert rf.rule_colors(["krum", "mean"]) == {"mean": rule_color("mean"), "krum": rule_color("krum")}
    assert rf.rule_colors(["krum"])["krum"] == rf.rule_colors(RULES)["krum"]
    # one table per kind, no colour used twice in it; unknown names are stable too
    assert len(set(RULE_COLORS.values())) == len(RULE_COLORS)
    assert len(set(ATTACK_COLORS.values())) == len(ATTACK_COLORS)
    assert rule_color("my_rule[s=2]") == rule_color("my_rule[s=2]")


def test_at_most_three_panels_a_row_and_compared_panels_share_axes() -> None:
    runs = _runs(RULES, ["none", "alie"])
    for fig in (rf.kappa_curves(runs, _kappa(runs), "iid"), rf.learning_curves(runs, _curves(runs), "iid")):
        axes = _visible(fig)
        assert len(axes) == len(RULES)
        lefts = {round(ax.get_position().x0, 3) for ax in axes}
        assert len(lefts) <= 3  # it was four panels in a 1860 x 374 strip
        assert len({ax.get_ylim() for ax in axes}) == 1  # one y range: panels are compared
        assert len({ax.get_xlim() for ax in axes}) == 1


def _trade(points: dict[str, dict[str, tuple[float, float]]], std: float = 0.004) -> pd.DataFrame:
    rows = []
    for setting, per_rule in points.items():
        for rule, (s, i) in per_rule.items():
            rows.append({"setting": setting, "rule": rule, "suppression_loss": s, "integrity_loss": i,
                         "suppression_std": std, "integrity_std": std, "frontier": rule == "mean", "seeds": 3})
    return pd.DataFrame(rows)


def test_tradeoff_axes_shared_not_zoomed_on_noise_and_error_bars_visible() -> None:
    # iid: every rule within 1.75 points (noise); dirichlet: 40 points apart
    iid = {r: (0.0025 * k, 0.01 + 0.0025 * k) for k, r in enumerate(RULES)}
    dirichlet = {r: (0.1 * k, 0.4 - 0.08 * k) for k, r in enumerate(RULES)}
    fig = rf.tradeoff_scatter(_trade({"iid": iid, "dirichlet(a=0.1)": dirichlet}), ["iid", "dirichlet(a=0.1)"])
    axes = _visible(fig)
    assert len(axes) == 2
    assert axes[0].get_xlim() == axes[1].get_xlim() and axes[0].get_ylim() == axes[1].get_ylim()
    alone = _visible(rf.tradeoff_scatter(_trade({"iid": iid}), ["iid"]))[0]
    for lo, hi in (alone.get_xlim(), alone.get_ylim()):
        assert hi - lo >= rf.MIN_SPAN_PP  # 1.75 points of spread is not drawn across the whole axis
    bars = [c for c in alone.collections if isinstance(c, matplotlib.collections.LineCollection)]
    assert bars and all((c.get_alpha() is None or c.get_alpha() >= 0.8) for c in bars)
    assert all(np.max(c.get_linewidths()) >= 1.0 for c in bars)


def test_tradeoff_labels_never_overlap() -> None:
    # nine rules crowded into one corner, two of them on the same spot
    names = ["mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
             "centered_clipping", "nnm>trimmed_mean", "bucketing>coordinate_median"]
    pts = {r: (0.001 * (k % 3), 0.001 * (k // 3)) for k, r in enumerate(names)}
    pts["krum"] = pts["mean"]
    fig = rf.tradeoff_scatter(_trade({"iid": pts}), ["iid"])
    ax = _visible(fig)[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [matplotlib.text.Text.get_window_extent(t, renderer) for t in ax.texts if t.get_text() in names]
    assert len(boxes) == len(names)
    for b1, b2 in itertools.combinations(boxes, 2):
        assert not b1.overlaps(b2), (b1, b2)


def test_kappa_floor_on_the_log_axis() -> None:
    runs = _runs(["mean", "krum"], ["none"])
    kappa = _kappa(runs)
    kappa.loc[kappa["run_id"].str.startswith("iid/mean"), "kappa_hat"] = 1e-15  # the mean with no attack
    fig = rf.kappa_curves(runs, kappa, "iid")
    for ax in _visible(fig):
        assert ax.get_ylim()[0] >= KAPPA_FLOOR / 2  # no 1e-15 decade on the axis
        for line in ax.get_lines():
            ys = np.asarray(line.get_ydata(), dtype=float)
            assert (ys >= KAPPA_FLOOR).all()


@pytest.mark.parametrize("fmt, magic", [("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_report_writes_pdf_or_svg(tmp_path: Path, fmt: str, magic: bytes) -> None:
    from tests.test_report import IID, make_run

    root = tmp_path / "sweep"
    for job, ((rule, attack), accs) in enumerate(IID.items()):
        make_run(root, job, rule, attack, "iid", 0, accs[0])
    out = tmp_path / "out"
    assert rep.main([str(root), "--out", str(out), "--no-wandb", "--format", fmt]) == 0
    figs = sorted(p for p in out.iterdir() if p.suffix == f".{fmt}")
    assert {p.stem for p in figs} >= {"accuracy_heatmap", "tradeoff", "kappa_iid", "learning_acc_iid"}
    assert not list(out.glob("*.png"))
    for p in figs:
        assert p.read_bytes()[:len(magic)] == magic
    assert f"accuracy_heatmap.{fmt}" in (out / "report.md").read_text()
    with pytest.raises(SystemExit):
        rep.main([str(root), "--out", str(out), "--format", "jpg"])


def test_figures_redraw_from_the_report_csv_files_alone(tmp_path: Path) -> None:
    from tests.test_report import IID, make_run

    root = tmp_path / "sweep"
    for job, ((rule, attack), accs) in enumerate(IID.items()):
        for seed, acc in enumerate(accs):
            make_run(root, 2 * job + seed, rule, attack, "iid", seed, acc)
    report = rep.build_report(root, tmp_path / "report", wandb=False)
    only_csv = tmp_path / "csv"
    only_csv.mkdir()
    for name in ("results.csv", "tradeoff.csv", "weights.csv"):
        (only_csv / name).write_bytes((report.out_dir / name).read_bytes())
    assert rep.main([str(only_csv), "--redraw", "--format", "svg"]) == 0  # the run folders are not needed
    assert {p.name for p in only_csv.glob("*.svg")} == {"accuracy_heatmap.svg", "tradeoff.svg", "weights_vs_skew.svg"}
    assert rep.main([str(tmp_path / "sweep"), "--redraw"]) == 2  # a sweep folder is not a report folder
