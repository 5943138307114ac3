"""The report's availability-vs-bias figure and the protocol columns it reads."""

from __future__ import annotations

import math

import pandas as pd

from experiments.report_config import protocol_axes
from experiments.report_figures import availability_vs_bias


def test_protocol_axes_read_participation_and_staleness():
    assert protocol_axes(None, 10) == {"protocol": "dsgd", "participation": 1.0, "tau": 0}
    local = {"_target_": "robustagg.protocols.LocalRounds", "clients_per_round": 10, "sampling": "uniform"}
    got = protocol_axes(local, 100)
    assert (got["protocol"], got["participation"], math.isnan(got["tau"])) == ("localrounds", 0.1, True)
    assert protocol_axes({**local, "sampling": "all"}, 100)["participation"] == 1.0
    asy = protocol_axes({"_target_": "robustagg.protocols.AsyncSGD", "max_staleness": 4}, 8)
    assert asy["tau"] == 4 and math.isnan(asy["participation"])  # async rows are not "full participation"


def _runs(axis):
    rows = []
    for v in (0.1, 0.5, 1.0):
        for rule in ("mean", "trimmed_mean"):
            for attack in ("none", "alie"):
                rows.append({"status": "ok", "rule": rule, "attack": attack, axis: v, "final_acc": 0.5 + v / 4,
                             "mean_kappa_hat": 0.1 / v, "mean_bias_vs_sync_rel": 0.2 / v,
                             "protocol": "localrounds" if axis == "participation" else "asyncsgd"})
    return pd.DataFrame(rows)


def test_the_axes_never_pool_two_protocols():
    # an async run at the same x as a local one must not enter the participation line (review finding)
    runs = _runs("participation")
    other = runs.assign(protocol="asyncsgd", final_acc=0.0)
    fig = availability_vs_bias(pd.concat([runs, other]), "participation")
    acc = [a for a in fig.axes if a.get_visible() and a.lines][0].lines[0]
    assert list(acc.get_ydata()) == [52.5, 62.5, 75.0]


def test_one_line_per_rule_and_attack_on_each_panel():
    fig = availability_vs_bias(_runs("participation"), "participation")
    axes = [a for a in fig.axes if a.get_visible() and a.lines]
    assert len(axes) == 3 and all(len(a.lines) == 4 for a in axes)
    acc = axes[0].lines[0]
    assert list(acc.get_xdata()) == [0.1, 0.5, 1.0] and list(acc.get_ydata()) == [52.5, 62.5, 75.0]
    assert {ln.get_linestyle() for ln in axes[0].lines} == {"-", "--"}


def test_no_figure_without_two_values_of_the_axis():
    runs = _runs("tau")
    assert availability_vs_bias(runs[runs["tau"] == 0.1], "tau") is None
    assert availability_vs_bias(runs, "participation") is None
