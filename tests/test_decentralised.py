"""Decentralised learning on a graph (issue 30): topologies, gossip weights, node rules, per-node
exposure, per-receiver attacks and the consensus experiment. Hand-computed values throughout."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from attacks.gossip import (GOSSIP_ATTACKS, Dissensus, GossipALIE, GossipIPM, GossipSignFlip, Split,
                            build_gossip_attack)
from robustagg.decentralised import graph as G
from robustagg.decentralised import rules as R
from robustagg.decentralised.exposure import check_exposure, exposure
from robustagg.decentralised.gossip import consensus_distance, gossip_round, honest_sides
from robustagg.errors import AssumptionError, AssumptionWarning, ConfigError, ShapeError

F64 = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=F64)


# --- topologies ------------------------------------------------------------------------------
def test_ring_torus_complete_exponential_dumbbell_have_the_stated_neighbourhoods():
    ring = G.ring(5)
    assert ring.edges() == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    torus = G.torus(16)
    assert torus.name == "torus(4x4)" and all(torus.degree(i) == 4 for i in range(16))
    assert torus.neighbours(0) == (1, 3, 4, 12)  # right, left (wrap), down, up (wrap)
    assert G.torus(12, rows=3).name == "torus(3x4)"
    assert all(G.complete(5).degree(i) == 4 for i in range(5))
    assert G.exponential(8).neighbours(0) == (1, 2, 4, 6, 7)  # 0 +- 1, +- 2, + 4
    bell = G.dumbbell(6)
    assert bell.edges() == [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (3, 5), (4, 5)]
    er = G.erdos_renyi(12, 0.5, seed=3)
    assert er.edges() == G.erdos_renyi(12, 0.5, seed=3).edges() != G.erdos_renyi(12, 0.5, seed=4).edges()


def test_bad_graphs_are_refused_naming_the_setting():
    with pytest.raises(ConfigError, match="torus_rows must divide"):
        G.torus(6, rows=4)
    with pytest.raises(ConfigError, match="not symmetric"):
        G.Graph("x", np.array([[0, 1], [0, 0]], dtype=bool))
    with pytest.raises(ConfigError, match="self-loops at nodes \\[1\\]"):
        G.Graph("x", np.array([[0, 1], [1, 1]], dtype=bool))
    with pytest.raises(ConfigError, match="two distinct nodes"):
        G.from_edges(3, [[0, 3]])
    with pytest.raises(ConfigError, match="edge_probability"):
        G.erdos_renyi(5, 0.0, seed=0)
    with pytest.raises(ConfigError, match="unknown protocol.topology 'grid'; choose one of ring"):
        G.build("grid", 4)
    with pytest.raises(ConfigError, match="even"):
        G.dumbbell(7)


def test_a_user_graph_reads_from_json_edges_a_json_matrix_and_text(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps([[0, 1], [1, 2]]))
    (tmp_path / "m.json").write_text(json.dumps([[0, 1, 0], [1, 0, 1], [0, 1, 0]]))
    (tmp_path / "e.txt").write_text("# a path\n0 1\n1,2\n")
    for name in ("e.json", "m.json", "e.txt"):
        assert G.from_file(tmp_path / name, 3).edges() == [(0, 1), (1, 2)]
    (tmp_path / "bad.txt").write_text("0 x\n")
    with pytest.raises(ConfigError, match="bad.txt' line 1"):
        G.from_file(tmp_path / "bad.txt", 3)
    with pytest.raises(ConfigError, match="cannot be read"):
        G.from_file(tmp_path / "missing.json", 3)


# --- gossip weights ---------------------------------------------------------------------------
def test_metropolis_and_uniform_weights_on_a_path_by_hand():
    path = G.from_edges(3, [[0, 1], [1, 2]])  # degrees 1, 2, 1
    w = G.mixing_matrix(path, "metropolis")
    assert np.allclose(w, [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]], atol=1e-15)
    u = G.mixing_matrix(path, "uniform")
    assert np.allclose(u, [[1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 2, 1 / 2]], atol=1e-15)
    with pytest.raises(ConfigError, match="unknown protocol.weights"):
        G.mixing_matrix(path, "max")


def test_metropolis_weights_are_symmetric_and_doubly_stochastic_on_an_irregular_graph():
    w = G.mixing_matrix(G.erdos_renyi(20, 0.3, seed=1), "metropolis")
    assert np.allclose(w, w.T) and np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1)
    assert (w >= 0).all()


def test_spectral_gap_by_hand():
    # ring(4), Metropolis: the circulant (1/3)(I + S + S^T), eigenvalues 1, 1/3, -1/3, 1/3: gap 2/3
    assert G.spectral_gap(G.mixing_matrix(G.ring(4))) == pytest.approx(2 / 3, abs=1e-12)
    # complete(5), uniform: J / 5, eigenvalues 1, 0, 0, 0, 0: gap 1
    assert G.spectral_gap(G.mixing_matrix(G.complete(5), "uniform")) == pytest.approx(1.0, abs=1e-12)


def test_byzantine_placement():
    assert G.place_byzantine(G.dumbbell(8), 2, "cut") == (3, 4)  # the bridge's ends
    star = G.from_edges(5, [[0, 1], [0, 2], [0, 3], [3, 4]])
    assert G.place_byzantine(star, 2, "max_degree") == (0, 3)
    r = G.place_byzantine(G.ring(10), 3, "random", seed=5)
    assert len(set(r)) == 3 and r == G.place_byzantine(G.ring(10), 3, "random", seed=5)
    assert G.place_byzantine(G.ring(10), 0, "cut") == ()
    with pytest.raises(ConfigError, match="unknown protocol.placement"):
        G.place_byzantine(G.ring(4), 1, "centre")
    with pytest.raises(ConfigError, match=r"must be in \[0, 3\]"):
        G.place_byzantine(G.ring(4), 4)


# --- node rules, by hand ---------------------------------------------------------------------
W3 = torch.tensor([0.25, 0.25, 0.25], dtype=F64)
W4 = torch.tensor([0.2, 0.2, 0.2, 0.2], dtype=F64)


def test_clipped_gossip_clips_the_f_farthest_to_the_next_distance():
    own = _t([0.0, 0.0])
    m = _t([[3.0, 0.0], [0.0, 4.0], [0.0, -10.0]])  # distances 3, 4, 10: radius 4 at f = 1
    out = R.ClippedGossip().mix(own, m, 0.25, W3, f=1)
    assert torch.allclose(out, _t([0.75, 0.0]), atol=1e-15)  # 0.25 (3, 0) + 0.25 (0, 4) + 0.25 (0, -4)
    out2 = R.ClippedGossip().mix(own, m, 0.25, W3, f=2)  # radius 3: (0, 3) and (0, -3)
    assert torch.allclose(out2, _t([0.75, 0.0]), atol=1e-15)


def test_bridge_nna_ios_and_a_server_rule_by_hand():
    own, m = _t([10.0]), _t([[1.0], [2.0], [3.0], [100.0]])
    assert R.BridgeTrimmedMean().mix(own, m, 0.2, W4, f=1).item() == pytest.approx(5.0)  # (2 + 3 + 10) / 3
    assert R.BridgeMedian().mix(own, m, 0.2, W4, f=1).item() == 3.0  # median of 10, 1, 2, 3, 100
    assert R.ServerRule("trimmed_mean").mix(own, m, 0.2, W4, f=1).item() == pytest.approx(5.0)  # 2, 3, 10 kept
    nna = R.NearestNeighbourAveraging().mix(_t([0.0]), _t([[1.0], [-2.0], [5.0]]), 0.25, W3, f=1)
    assert nna.item() == pytest.approx(-1 / 3)  # own, 1 and -2 kept
    # IOS: average (0 + 1 + 2 + 9) / 4 = 3, 9 is farthest and dropped, then (0 + 1 + 2) / 3
    assert R.IOS().mix(_t([0.0]), _t([[1.0], [2.0], [9.0]]), 0.25, W3, f=1).item() == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="k >= 2f \\+ 1"):
        R.BridgeTrimmedMean().mix(own, m[:2], 0.2, W4[:2], f=1)


def test_every_rule_keeps_a_node_that_agrees_with_all_neighbours_where_it_is():
    own = _t([1.5, -2.0, 0.25])
    m = own.expand(4, -1).clone()
    for name in R.NODE_RULES + ("server:geometric_median", "server:nnm>krum"):
        rule = R.build_node_rule(name)
        assert torch.allclose(rule.mix(own, m, 0.2, W4, f=1), own, atol=1e-12), name


def test_node_rule_names_and_parameters_are_checked():
    with pytest.raises(ConfigError, match="unknown protocol.node_rule 'clip'"):
        R.build_node_rule("clip")
    with pytest.raises(ConfigError, match="unknown aggregator"):
        R.build_node_rule("server:nope")
    with pytest.raises(ConfigError, match="clip_radius"):
        R.build_node_rule("self_centred_clipping", clip_radius=-1.0)


# --- per-node exposure -------------------------------------------------------------------------
def test_a_rule_whose_requirement_fails_at_a_node_s_degree_is_refused_naming_the_node():
    with pytest.raises(AssumptionError, match=r"honest nodes 1 \(Byzantine neighbours \[0\]\), 2, 3, 4, 5 "
                                              r"\(Byzantine neighbours \[0\]\) \(degree 2\): BRIDGE-M requires n >= "
                                              r"2f \+ 1 .* got n=3, f=2\. Use a denser topology"):
        check_exposure(G.ring(6), (0,), R.BridgeMedian(), node_f=2)
    rep = check_exposure(G.ring(6), (0,), R.BridgeMedian(), node_f=1)  # n = 3 >= 2f + 1
    assert rep["violations"] == [] and rep["honest_connected"]


def test_more_byzantine_neighbours_than_node_f_and_a_disconnected_honest_graph_are_refused():
    rep = exposure(G.ring(6), (0, 2), R.ClippedGossip(), node_f=1)
    text = " ".join(rep["violations"])
    assert "honest node 1 (degree 2, Byzantine neighbours [0, 2]) has 2 Byzantine neighbours" in text
    assert "raise protocol.node_f to 2" in text
    assert "disconnected" in text and "components [[1], [3, 4, 5]]" in text
    assert not rep["honest_connected"] and rep["spectral_gap"] == 0.0


def test_byzantine_neighbours_holding_half_the_weight_are_refused_and_strict_false_warns():
    # complete(4), Metropolis: every weight 1/4; node 2's Byzantine neighbours 0 and 1 hold 1/2
    with pytest.warns(AssumptionWarning, match=r"hold 0\.500 of its gossip weight"):
        rep = check_exposure(G.complete(4), (0, 1), R.ClippedGossip(), node_f=2, strict=False)
    assert rep["byzantine_weight_max"] == pytest.approx(0.5)
    with pytest.raises(AssumptionError, match="Or pass strict=false"):
        check_exposure(G.complete(4), (0, 1), R.ClippedGossip(), node_f=2)


def test_a_server_rule_at_a_node_is_checked_with_its_own_requirement():
    with pytest.raises(AssumptionError, match="Krum requires n >= 2f \\+ 3"):
        check_exposure(G.torus(16), (0,), R.ServerRule("krum"), node_f=2)  # degree 4: n = 5 < 2 * 2 + 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_exposure(G.exponential(16), (0,), R.ServerRule("krum"), node_f=1)  # degree 7: n = 8 >= 5


# --- attacks against one receiver's view ----------------------------------------------------------
def test_gossip_attacks_by_hand():
    own, honest = _t([0.0]), _t([[2.0]])
    wh, wb = _t([0.25]), _t([0.25, 0.25])
    # dissensus: x_i - eps * (0.25 * 2) / 0.5 = -eps
    assert Dissensus(epsilon=1.5)(own, honest, wh, wb, torch.zeros(2, 1, dtype=F64)).tolist() == [[-1.5], [-1.5]]
    # ALIE on the view {0, 2}: mean 1, unbiased std sqrt(2)
    alie = GossipALIE(z=1.0)(own, honest, wh, wb[:1], torch.zeros(1, 1, dtype=F64))
    assert alie.item() == pytest.approx(1.0 - math.sqrt(2.0))
    assert GossipIPM(epsilon=0.5)(_t([2.0]), _t([[4.0]]), wh, wb[:1], torch.zeros(1, 1, dtype=F64)).item() == -1.5
    assert GossipSignFlip()(own, honest, wh, wb, _t([[3.0], [-1.0]])).tolist() == [[-3.0], [1.0]]
    u = _t([1.0, 0.0])
    s0 = Split(epsilon=1.0)(_t([0.0, 0.0]), _t([[3.0, 4.0]]), wh, wb[:1], torch.zeros(1, 2, dtype=F64), side=0,
                            direction=u)
    s1 = Split(epsilon=1.0)(_t([0.0, 0.0]), _t([[3.0, 4.0]]), wh, wb[:1], torch.zeros(1, 2, dtype=F64), side=1,
                            direction=u)
    assert s0.tolist() == [[5.0, 0.0]] and s1.tolist() == [[-5.0, 0.0]]  # r = 5


def test_gossip_attack_names_and_parameters_are_checked():
    with pytest.raises(ConfigError, match="has no gossip form; under protocol=gossip choose one of dissensus, split"):
        build_gossip_attack("min_max")
    with pytest.raises(ConfigError, match="attack 'dissensus'"):
        build_gossip_attack("dissensus", z=1.0)
    with pytest.raises(ConfigError, match="attack.epsilon"):
        Dissensus(epsilon=float("inf"))


def test_dissensus_at_epsilon_one_cancels_the_honest_pull_of_plain_gossip_exactly():
    g = G.torus(16)
    w = G.mixing_matrix(g)
    byz = (0, 1)
    x = torch.randn(16, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    y, _ = gossip_round(x, g, w, byz, R.GossipAverage(), node_f=1, attack=Dissensus(epsilon=1.0))
    exposed = [i for i in range(16) if i not in byz and set(g.neighbours(i)) & set(byz)]
    assert exposed and torch.allclose(y[exposed], x[exposed], atol=1e-12)  # they do not move at all
    others = [i for i in range(16) if i not in byz and i not in exposed]
    assert not torch.allclose(y[others], x[others])


def test_every_gossip_attack_sends_finite_messages_and_consumes_the_generator_only_when_it_draws():
    g = G.exponential(12)
    w = G.mixing_matrix(g)
    x = torch.randn(12, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    for name in GOSSIP_ATTACKS:
        y, info = gossip_round(x, g, w, (2, 7), R.ClippedGossip(), node_f=2, attack=build_gossip_attack(name),
                               generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(y).all(), name
        assert set(info["kappa"]) == set(range(12)) - {2, 7}


# --- the mixing round ------------------------------------------------------------------------
def test_one_round_of_gossip_on_the_complete_graph_with_uniform_weights_is_the_mean():
    g = G.complete(5)
    x = torch.randn(5, 7, dtype=F64, generator=torch.Generator().manual_seed(2))
    y, info = gossip_round(x, g, G.mixing_matrix(g, "uniform"), (), R.GossipAverage(), node_f=0)
    assert torch.allclose(y, x.mean(dim=0).expand(5, -1), atol=1e-14)
    assert consensus_distance(y, range(5)) == pytest.approx(0.0, abs=1e-28)
    assert all(v == pytest.approx(0.0, abs=1e-25) for v in info["kappa"].values())


def test_gossip_round_refuses_wrong_shapes():
    g = G.ring(4)
    with pytest.raises(ShapeError, match=r"\(4, d\) floating"):
        gossip_round(torch.zeros(3, 2), g, G.mixing_matrix(g), (), R.GossipAverage(), node_f=0)
    with pytest.raises(ShapeError, match="gossip weights"):
        gossip_round(torch.zeros(4, 2), g, np.eye(3), (), R.GossipAverage(), node_f=0)


def test_consensus_distance_by_hand_and_the_honest_sides_of_a_path():
    x = _t([[0.0], [2.0], [100.0]])
    assert consensus_distance(x, [0, 1]) == 1.0  # mean 1: (1 + 1) / 2
    sides = honest_sides(G.from_edges(6, [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]), ())
    assert sorted(sides.values()) == [0, 0, 0, 1, 1, 1] and sides[0] != sides[5] and sides[0] == sides[1]


def _consensus(g, byz, rule, attack, rounds, node_f):
    w = G.mixing_matrix(g)
    x = torch.randn(g.num_nodes, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    honest = [i for i in range(g.num_nodes) if i not in byz]
    start = consensus_distance(x, honest)
    for _ in range(rounds):
        x, _ = gossip_round(x, g, w, byz, rule, node_f=node_f, attack=attack,
                            generator=torch.Generator().manual_seed(0))
    return start, consensus_distance(x, honest)


def test_dissensus_breaks_plain_gossip_and_clipped_gossip_keeps_the_honest_nodes_together():
    """The qualitative result of He, Karimireddy, Jaggi (2022), consensus under the dissensus attack."""
    attack = Dissensus(epsilon=1.05)
    for g, byz in ((G.torus(16), (0, 1)), (G.ring(12), (0,))):
        attack = Dissensus(epsilon=1.05 if g.name.startswith("torus") else 2.0)
        start, plain = _consensus(g, byz, R.GossipAverage(), attack, 100, node_f=1)
        _, clipped = _consensus(g, byz, R.ClippedGossip(), attack, 100, node_f=1)
        assert plain > 10 * start, (g.name, start, plain)  # pushed apart
        assert clipped < start, (g.name, start, clipped)  # held together
    start, clipped = _consensus(G.torus(16), (0, 1), R.ClippedGossip(), Dissensus(epsilon=1.05), 100, node_f=1)
    assert clipped < 1e-6 * start  # on the torus they reach one model


def test_the_refusals_the_page_quotes_are_what_the_checks_say():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "decentralised.md").read_text(encoding="utf-8")
    quoted = page.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    ring = exposure(G.ring(16), (), R.BridgeTrimmedMean(), node_f=1)["cannot_run"]
    assert len(ring) == 1 and quoted[0] == ring[0].replace(", ".join(map(str, range(3, 15))), "...")
    bell = G.dumbbell(8)
    assert quoted[1] == exposure(bell, G.place_byzantine(bell, 2, "cut"), R.ClippedGossip(), node_f=2)["violations"][0]


def test_the_consensus_verdict_quotes_the_committed_experiment():
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    t = pd.read_csv(root / "docs" / "results" / "gossip_consensus.csv", keep_default_na=False, na_values=[""])
    page = (root / "docs" / "decentralised.md").read_text(encoding="utf-8")
    verdict = " ".join(page.split("**Verdict.**", 1)[1].split("\n\n", 1)[0].split())

    def end(topo, rule, attack):
        row = t[t["topology"].str.startswith(topo) & (t["rule"] == rule) & (t["attack"] == attack)].iloc[0]
        return row

    e105, e2 = "dissensus epsilon=1.05", "dissensus epsilon=2.0"
    for topo in ("torus", "exponential", "erdos_renyi"):
        plain, clipped = end(topo, "gossip", e105), end(topo, "clipped_gossip", e105)
        assert f"{plain['consensus_end']:.1e}" in verdict and f"{clipped['consensus_end']:.1e}" in verdict
        assert plain["consensus_end"] > 1e4 * plain["consensus_start"] > clipped["consensus_end"] * 1e10
        assert end(topo, "gossip", e2)["status"] == "diverged"
    assert end("ring", "gossip", e2)["status"] == "diverged"
    for rule, attack in (("gossip", e105), ("gossip", "none"), ("clipped_gossip", e105), ("clipped_gossip", e2),
                         ("clipped_gossip", "none"), ("nna", "none"), ("ios", "none"), ("bridge_median", "none"),
                         ("server:trimmed_mean", "none")):
        assert f"{end('ring', rule, attack)['consensus_end']:.1e}" in verdict, (rule, attack)
    assert end("ring", "clipped_gossip", e105)["consensus_end"] < end("ring", "gossip", e105)["consensus_end"]


def test_committed_consensus_cells_are_what_the_code_computes_now():
    from pathlib import Path

    import pandas as pd
    import yaml

    from experiments.gossip_consensus import COLUMNS, run_cell

    root = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((root / "conf" / "gossip_consensus" / "gossip_consensus.yaml").read_text())
    t = pd.read_csv(root / "docs" / "results" / "gossip_consensus.csv", keep_default_na=False, na_values=[""])
    torus = next(x for x in cfg["topologies"] if x["name"] == "torus")
    ring = next(x for x in cfg["topologies"] if x["name"] == "ring")
    for topo, rule, attack in ((torus, "gossip", {"name": "dissensus", "epsilon": 1.05}),
                               (torus, "clipped_gossip", {"name": "dissensus", "epsilon": 1.05}),
                               (ring, "bridge_trimmed_mean", {"name": "none"}),
                               (ring, "nna", {"name": "none"})):
        row = run_cell(topo, rule, attack, cfg)
        label = row["attack"]
        want = t[t["topology"].str.startswith(topo["name"]) & (t["rule"] == rule) & (t["attack"] == label)].iloc[0]
        for col in COLUMNS:
            got, exp = row[col], want[col]
            if isinstance(exp, float) and math.isnan(exp):  # an empty text cell reads back as NaN too
                assert got == "" or (isinstance(got, float) and math.isnan(got)), (rule, col)
            elif isinstance(exp, float):
                assert float(got) == pytest.approx(exp, rel=1e-9, abs=1e-300), (rule, col)
            else:
                assert str(got) == str(exp), (rule, col)


def _verdict(page: str, title: str) -> str:
    return " ".join(page.split(f"**Verdict ({title}).**", 1)[1].split("\n\n", 1)[0].split())


@pytest.mark.parametrize("folder,title,floors", [("decentralised_digits", "digits", ("93.8", "95.8")),
                                                  ("decentralised_fmnist", "Fashion-MNIST", ("75.6", "77.2"))])
def test_the_training_verdicts_quote_the_committed_runs(folder, title, floors):
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    t = pd.read_csv(root / "docs" / "results" / folder / "results.csv", keep_default_na=False, na_values=[""])
    verdict = _verdict((root / "docs" / "decentralised.md").read_text(encoding="utf-8"), title)

    def cell(topo, rule, attack, col):
        row = t[(t["topology"] == topo) & (t["node_rule"] == rule) & (t["attack"] == attack)]
        assert len(row) == 1 and row["status"].iloc[0] == "ok", (topo, rule, attack)
        return float(row[col].iloc[0])

    for topo in ("ring", "torus", "exponential"):
        plain, clipped = cell(topo, "gossip", "dissensus", "worst_node_acc"), cell(topo, "clipped_gossip", "dissensus",
                                                                                    "worst_node_acc")
        calm = cell(topo, "gossip", "none", "worst_node_acc")
        for v in (plain, clipped, calm):
            assert f"{100 * v:.1f} %" in verdict, (topo, v)
        assert plain < clipped - 0.05 and plain < calm - 0.2
    for topo in ("torus", "exponential"):
        for rule in ("gossip", "clipped_gossip"):
            assert f"{cell(topo, rule, 'dissensus', 'consensus_distance'):.1e}" in verdict
    for rule in ("nna", "ios", "server:trimmed_mean"):
        assert f"{100 * cell('ring', rule, 'none', 'worst_node_acc'):.1f} %" in verdict
        assert f"{cell('ring', rule, 'none', 'consensus_distance'):.1e}" in verdict
    assert f"{cell('ring', 'gossip', 'none', 'consensus_distance'):.1e}" in verdict
    for topo, floor in zip(("torus", "exponential"), floors):
        calm = t[(t["topology"] == topo) & (t["attack"] == "none") & (t["status"] == "ok")]
        assert f"{100 * calm['worst_node_acc'].min():.1f}" == floor and f"{floor} %" in verdict


def test_malformed_user_graphs_are_refused_naming_where_they_came_from(tmp_path):
    for bad, match in ((5, "expected a list of edges"), ([[0, 1], [1, 2], None], "pair of integer node ids"),
                       ([], "holds no edge"), ({"0": 1}, "expected a list of edges"),
                       ([[0, 1.0]], "pair of integer node ids")):
        with pytest.raises(ConfigError, match=match):
            G.from_edges(4, bad)
    (tmp_path / "m2.json").write_text(json.dumps([[0, 1], [1, 0]]))
    assert G.from_file(tmp_path / "m2.json", 2).edges() == [(0, 1)]  # a 2 x 2 list at n = 2 is a matrix
    (tmp_path / "loops.json").write_text(json.dumps([[1, 0], [0, 1]]))
    with pytest.raises(ConfigError, match="loops.json'.*self-loops"):
        G.from_file(tmp_path / "loops.json", 2)
    (tmp_path / "m3.json").write_text(json.dumps([[0, 1, 1], [1, 0, 1], [1, 1, 0]]))
    with pytest.raises(ConfigError, match=r"a 3 x 3 adjacency matrix, but threat.n=4: it must be 4 x 4"):
        G.from_file(tmp_path / "m3.json", 4)
    (tmp_path / "float.json").write_text(json.dumps([[0, 1.0], [1, 2]]))
    with pytest.raises(ConfigError, match="protocol.adjacency_file '.*float.json': every edge is a pair"):
        G.from_file(tmp_path / "float.json", 4)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="empty.txt' holds no edge"):
        G.from_file(tmp_path / "empty.txt", 4)
    with pytest.raises(ConfigError, match="a torus of 7 nodes needs n = rows x columns"):
        G.torus(7)


def test_the_spectral_gap_of_uniform_weights_is_the_row_stochastic_matrix_s_own():
    # path 0 - 1 - 2, uniform: trace 4/3 = 1 + l2 + l3, det -1/12 = l2 l3: l2, l3 = 1/2, -1/6
    w = G.mixing_matrix(G.from_edges(3, [[0, 1], [1, 2]]), "uniform")
    assert G.spectral_gap(w) == pytest.approx(0.5, abs=1e-12)


def test_a_rule_that_cannot_be_computed_at_a_node_is_refused_even_to_study_breakdown():
    with pytest.raises(AssumptionError, match=r"honest nodes 1, 2, 3, 4, 5 \(degree 2\): BRIDGE-T cannot trim f=1"):
        check_exposure(G.ring(6), (0,), R.BridgeTrimmedMean(), node_f=1, strict=False)
    with pytest.raises(AssumptionError, match="NNA cannot drop f=1 of k=0"):
        check_exposure(G.from_edges(3, [[0, 1]]), (), R.NearestNeighbourAveraging(), node_f=1, strict=False)


def test_gossip_alie_refuses_a_receiver_where_its_z_is_undefined():
    GossipALIE().check_view(8, 2)  # defined
    GossipALIE(z=1.0).check_view(5, 3)  # an explicit z always is
    with pytest.raises(ConfigError, match=r"5 inputs and 3 Byzantine neighbours .*pass attack.z=1.0"):
        GossipALIE().check_view(5, 3)
